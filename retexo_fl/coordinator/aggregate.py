"""Model aggregation: FedAvg's weighted mean of client states."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from retexo_fl.records import StateDict


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """FedAvg: ``sum_i w_i * state_i / sum_i w_i``, key by key (float64 accumulation).

    Args:
        states (Sequence[StateDict]): the client states; every one must hold the first one's tensors,
            in the same shapes (tensors only later states hold are ignored).
        weights (Sequence[float]): one weight per state, e.g. its training-node count.

    Shapes:
        - **input:** every ``states[i][key]`` the shape of ``states[0][key]``
        - **output:** one tensor per key of ``states[0]``, in its shape and dtype

    Returns:
        The weighted mean, each tensor cast back to the first state's dtype.

    Raises:
        ValueError: on no states, a state missing one of the first state's tensors or holding it in
            another shape, or weights that sum to zero or less.
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

    Args:
        new (StateDict): the state a client sent.
        reference (StateDict): the state it must match (the one the client trained from).
        source (str): who sent ``new``, for error messages (e.g. ``"client 3"``).

    Shapes:
        - **input:** every ``new[key]`` the shape of ``reference[key]``
        - **output:** ``new``, unchanged

    Returns:
        ``new`` itself.

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
    """Exact payload bytes of a state's tensors (``numel * element_size``, summed).

    Args:
        state (StateDict): the state.
    """
    return sum(t.numel() * t.element_size() for t in state.values())


class ServerOptimizer:
    """Applies the averaged client update to the global state as a pseudo-gradient (FedOpt).

    ``avg`` takes the average as the new state (FedAvg). ``adam`` treats
    ``global - average`` as a gradient for :class:`torch.optim.Adam` with ``lr`` (FedAdam). With
    one local SGD step per round, that pseudo-gradient is the clients' learning rate times the
    full-graph gradient (the clients' gradients weighted by the aggregation weights); Adam does
    not see that scale (up to its ``eps``), so federated training follows centralized Adam.

    Args:
        kind (str): ``"avg"`` or ``"adam"``.
        state (StateDict): the initial global state; it is copied (as float32), never modified.
        lr (float): Adam's learning rate (unused by ``avg``).

    Raises:
        ValueError: on an unknown ``kind``.
    """

    def __init__(self, kind: str, state: StateDict, lr: float) -> None:
        if kind not in ("avg", "adam"):
            raise ValueError(f"unknown server optimizer {kind!r}")
        self.kind = kind
        self.params = {k: v.detach().clone().float().requires_grad_(True) for k, v in state.items()}
        self.opt = torch.optim.Adam(self.params.values(), lr=lr) if kind == "adam" else None

    def step(self, average: StateDict) -> StateDict:
        """The next global state from this round's aggregate.

        Args:
            average (StateDict): the round's aggregate (e.g. from :func:`apply_updates`), with the
                initial state's keys and shapes.

        Shapes:
            - **input:** every ``average[key]`` the shape of the global state's ``key``
            - **output:** the new global state, same keys and shapes

        Returns:
            Fresh float32 tensors (never modified afterwards, so callers may keep them).
        """
        if self.opt is None:
            for k, v in average.items():
                self.params[k].data.copy_(v)
        else:
            for k, p in self.params.items():
                p.grad = p.data - average[k].to(p.dtype)
            self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}

    def __getstate__(self) -> dict:
        """What a checkpoint keeps: the parameters and Adam's state dict (tensors and plain
        containers, which a ``weights_only`` load accepts), not the optimizer object."""
        params = {k: p.detach().clone() for k, p in self.params.items()}
        return {"kind": self.kind, "params": params, "opt": self.opt.state_dict() if self.opt else None}

    def __setstate__(self, saved: dict) -> None:
        self.kind = saved["kind"]
        self.params = {k: v.clone().float().requires_grad_(True) for k, v in saved["params"].items()}
        self.opt = None
        if saved["opt"] is not None:
            self.opt = torch.optim.Adam(self.params.values())
            self.opt.load_state_dict(saved["opt"])


def apply_updates(
    state: StateDict, view: StateDict, states: list[StateDict], weights: list[float]
) -> StateDict:
    """``state`` plus the weighted mean of the clients' updates ``states[i] - view``.

    When clients trained from the state itself (``view is state``) this is plain FedAvg.

    Args:
        state (StateDict): the server's global state.
        view (StateDict): the state the clients trained from (a compressed broadcast's view, or
            ``state`` itself).
        states (list[StateDict]): the clients' trained states.
        weights (list[float]): one aggregation weight per client.

    Shapes:
        - **input:** every tensor of ``view`` and ``states[i]`` the shape of ``state``'s
        - **output:** one tensor per key of ``state``, in its shape and dtype

    Raises:
        ValueError: as :func:`weighted_average` does.
    """
    if view is state:
        return weighted_average(states, weights)
    deltas = [{k: s[k].float() - view[k].float() for k in view} for s in states]
    mean = weighted_average(deltas, weights)
    return {k: (state[k].float() + mean[k]).to(state[k].dtype) for k in state}
