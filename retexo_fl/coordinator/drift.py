"""The server's half of SCAFFOLD's drift correction: its control variate and its copy of every
client's (the algorithm and what travels: :mod:`retexo_fl.scaffold`)."""

from __future__ import annotations

from retexo_fl import protocol as P
from retexo_fl.compress.updates import ModelBroadcast
from retexo_fl.protocol import Records
from retexo_fl.records import StateDict
from retexo_fl.scaffold import next_client_control, zeros_like_state


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
        self.broadcast = ModelBroadcast(bits, half, seed, catch_up=False)  # every client, every round
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
