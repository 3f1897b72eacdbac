"""Model aggregation: FedAvg's weighted mean of client states."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

StateDict = dict[str, Tensor]


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """FedAvg: ``sum_i w_i * state_i / sum_i w_i``, key by key (float64 accumulation).

    Raises:
        ValueError: on no states, mismatched keys or shapes, or a zero total weight.
    """
    if not states:
        raise ValueError("nothing to aggregate")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights sum to zero (no client has training nodes?)")
    keys = list(states[0])
    out = {}
    for key in keys:
        acc = torch.zeros_like(states[0][key], dtype=torch.float64)
        for i, (s, w) in enumerate(zip(states, weights, strict=True)):
            if key not in s or s[key].shape != states[0][key].shape:
                raise ValueError(f"client state {i}: tensor {key!r} missing or of another shape")
            acc += s[key].double() * (float(w) / total)
        out[key] = acc.to(states[0][key].dtype)
    return out


def check_state(new: StateDict, reference: StateDict, source: str) -> StateDict:
    """``new`` if it has ``reference``'s tensors, shapes and a float dtype, all finite.

    Raises:
        ValueError: naming ``source`` and the first tensor that is missing, extra, misshapen,
            of the wrong dtype, or not finite.
    """
    missing, extra = sorted(set(reference) - set(new)), sorted(set(new) - set(reference))
    if missing or extra:
        raise ValueError(f"update from {source}: missing tensors {missing}, unexpected tensors {extra}")
    for key, ref in reference.items():
        t = new[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"update from {source}: {key} has shape {list(t.shape)}, expected {list(ref.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"update from {source}: {key} has dtype {t.dtype}, expected a float tensor")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"update from {source}: {key} holds NaN or Inf")
    return new


def state_nbytes(state: StateDict) -> int:
    """Exact payload bytes of a state's tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


class ServerOptimizer:
    """Applies the averaged client update to the global state as a pseudo-gradient (FedOpt).

    ``avg`` takes the average as the new state (FedAvg). ``adam`` treats
    ``global - average`` as a gradient for :class:`torch.optim.Adam` with ``lr`` (FedAdam). With
    one local SGD step per round, that pseudo-gradient is the client-count-weighted full-graph
    gradient, so federated training follows centralized Adam exactly.
    """

    def __init__(self, kind: str, state: StateDict, lr: float) -> None:
        if kind not in ("avg", "adam"):
            raise ValueError(f"unknown server optimizer {kind!r}")
        self.kind = kind
        self.params = {k: v.detach().clone().float().requires_grad_(True) for k, v in state.items()}
        self.opt = torch.optim.Adam(self.params.values(), lr=lr) if kind == "adam" else None

    def step(self, average: StateDict) -> StateDict:
        if self.opt is None:
            for k, v in average.items():
                self.params[k].data.copy_(v)
        else:
            for k, p in self.params.items():
                p.grad = p.data - average[k].to(p.dtype)
            self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}


def apply_updates(
    state: StateDict, view: StateDict, states: list[StateDict], weights: list[float]
) -> StateDict:
    """``state`` plus the weighted mean of the clients' updates ``states[i] - view``.

    When clients trained from the state itself (``view is state``) this is plain FedAvg.
    """
    if view is state:
        return weighted_average(states, weights)
    deltas = [{k: s[k].float() - view[k].float() for k in view} for s in states]
    mean = weighted_average(deltas, weights)
    return {k: (state[k].float() + mean[k]).to(state[k].dtype) for k in state}
