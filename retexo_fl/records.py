"""The record types both wings share: a model state and one client's evaluation.

A leaf of the package graph (torch only): :mod:`retexo_fl.party` and
:mod:`retexo_fl.coordinator` import each other never, and exchange messages only
(:mod:`retexo_fl.protocol`); what a message's records decode to is typed here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

#: A model's state: parameter name -> tensor.
StateDict = dict[str, Tensor]


def state_digest(state: StateDict) -> str:
    """SHA-256 of a state's names, dtypes, shapes and values, 16 bytes in hex.

    Equal on server and client exactly when both hold the same bits: a message can name a state
    the client holds by this digest instead of carrying it (:data:`~retexo_fl.protocol.HELD`).
    """
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def same_bits(a: StateDict, b: StateDict) -> bool:
    """Whether two states hold the same names, dtypes, shapes and bits (as :func:`state_digest`
    would say, without hashing: ``0.0`` and ``-0.0`` differ, a NaN equals itself)."""
    if a is b:
        return True
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


@dataclass
class EvalResult:
    """One client's evaluation of a state on one split.

    Args:
        correct (int): correctly classified nodes.
        count (int): nodes of the split.
        loss_sum (float): summed cross-entropy over them.
    """

    correct: int
    count: int
    loss_sum: float

    @property
    def accuracy(self) -> float:
        """``correct / count`` (0 for an empty split)."""
        return self.correct / self.count if self.count else 0.0
