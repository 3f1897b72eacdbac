r"""Drift correction for many local steps a round: SCAFFOLD's control variates.

With ``K`` local steps a round, a client on a skewed partition walks towards its own optimum, and
the average of such walks is not a step of the whole graph's gradient (client drift). SCAFFOLD
(Karimireddy et al., ICML 2020) corrects every local gradient by :math:`c - c_i`, where
:math:`c_i` estimates client :math:`i`'s gradient and :math:`c` the whole graph's:

.. math::
    y \leftarrow y - \eta \left( \nabla L_i(y) - c_i + c \right), \qquad
    c_i^+ = c_i - c + \frac{x - y_i}{K \eta}, \qquad
    c^+ = \sum_i w_i c_i^+ \Big/ \sum_i w_i

(its "option II"), with :math:`x` the model the round started from and :math:`w_i` the same
training-node weights the model average uses.

What travels: nothing up. No client sends :math:`c_i`: the server derives every
:math:`c_i^+` from the update it decoded (:math:`y_i`), the steps the client reported and the
local learning rate, and the client derives its own from the same decoded update, so both hold
the same :math:`c_i`. Down, :math:`c` goes with every train message but a stage's first (where
it is zero, which clients know), whole or, with ``broadcast-bits`` below 32, as compressed
deltas from what clients hold, exactly like the model broadcast. Both sides then use the
clients' view of :math:`c`, so the compression changes what is corrected, never the agreement.

With one local step (``K = 1``) the correction cancels in the average: the averaged update is
the whole-graph gradient step, as without correction.
"""

from __future__ import annotations

import torch

from retexo_fl import protocol as P
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.protocol import Records
from retexo_fl.training.aggregate import StateDict


def zeros_like_state(state: StateDict) -> StateDict:
    """A control variate of zeros (float32, CPU) with ``state``'s keys and shapes.

    Args:
        state (StateDict): the model state the control variate belongs to.
    """
    return {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in state.items()}


def next_client_control(
    own: StateDict, control: StateDict, base: StateDict, trained: StateDict, steps: int, lr: float
) -> StateDict:
    r"""A client's next control variate :math:`c_i^+ = c_i - c + (x - y_i) / (K \eta)`.

    Args:
        own (StateDict): the client's control variate :math:`c_i` this round.
        control (StateDict): the server's control variate :math:`c` this round.
        base (StateDict): the model the round started from, :math:`x`.
        trained (StateDict): the client's model after its local steps as the server decodes it,
            :math:`y_i`.
        steps (int): local steps taken, :math:`K`; with none, :math:`c_i` stays as it is.
        lr (float): the local learning rate, :math:`\eta`.

    Shapes:
        - **input / output:** every tensor the shape of the model state's
    """
    if steps <= 0:
        return own
    scale = 1.0 / (steps * lr)
    return {k: own[k] - control[k] + (base[k].float() - trained[k].float()) * scale for k in control}


class ServerControl:
    r"""The server's control variate :math:`c`, its broadcast, and its copy of every client's
    :math:`c_i`.

    Args:
        state (StateDict): the stage's initial model state (for keys and shapes).
        lr (float): the clients' local learning rate :math:`\eta` this stage.
        bits (int, optional): width of :math:`c`'s broadcast deltas (32: whole). (default: :obj:`32`)
        half (str, optional): dtype of the deltas' per-row ranges. (default: :obj:`"fp16"`)
        seed (int, optional): seed of the deltas' stochastic rounding. (default: :obj:`0`)
    """

    def __init__(
        self, state: StateDict, lr: float, bits: int = 32, half: str = "fp16", seed: int = 0
    ) -> None:
        self.control = zeros_like_state(state)
        self.lr = lr
        self.clients: dict[int, StateDict] = {}
        self.broadcast = ModelBroadcast(bits, half, seed)
        # Round 1: c is zero and every client starts from zero without being told.
        self.view = self.broadcast.prepare(self.control, 1)
        self.round = 1

    def records(self) -> Records:
        """What goes with this round's train messages: nothing in a stage's first round, else
        :math:`c` whole (:data:`~retexo_fl.protocol.CONTROL`) or as delta frames
        (:data:`~retexo_fl.protocol.CONTROL_FRAMES`)."""
        if self.round <= 1:
            return {}
        if self.broadcast.frames is None:
            return {P.CONTROL: self.view}
        return {P.CONTROL_FRAMES: self.broadcast.frames}

    def nbytes(self) -> int:
        """Bytes of :meth:`records` per client."""
        return 0 if self.round <= 1 else self.broadcast.nbytes()

    def raw_nbytes(self) -> int:
        """Bytes :meth:`records` would take per client at float32."""
        return 0 if self.round <= 1 else sum(t.numel() * 4 for t in self.control.values())

    def step(
        self,
        pids: list[int],
        base: StateDict,
        states: list[StateDict],
        steps: list[int],
        weights: list[float],
    ) -> None:
        """Advance every client's :math:`c_i` from its decoded update, then :math:`c` as their
        weighted mean, and prepare the next round's broadcast of it. Clients no longer in
        ``pids`` (lost) drop out of the mean.

        Args:
            pids (list[int]): the clients that replied this round.
            base (StateDict): the model they trained from, :math:`x`.
            states (list[StateDict]): their decoded models :math:`y_i`, in ``pids`` order.
            steps (list[int]): their local steps, in ``pids`` order.
            weights (list[float]): their aggregation weights, in ``pids`` order.
        """
        zero = zeros_like_state(self.control)
        for pid, trained, k in zip(pids, states, steps, strict=True):
            own = self.clients.get(pid, zero)
            # The clients corrected by the c they hold (the view), so their c_i follows it too.
            self.clients[pid] = next_client_control(own, self.view, base, trained, k, self.lr)
        self.clients = {pid: self.clients[pid] for pid in pids}
        total = float(sum(weights))
        self.control = {
            k: sum(self.clients[p][k] * (w / total) for p, w in zip(pids, weights, strict=True))
            for k in self.control
        }
        self.round += 1
        self.view = self.broadcast.prepare(self.control, self.round)
