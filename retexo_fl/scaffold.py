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

from retexo_fl.records import StateDict


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
