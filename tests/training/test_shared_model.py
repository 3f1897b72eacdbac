"""The module a thread's clients share (LazyClient.loaded_model): a state is loaded again
unless the module still holds it exactly."""

from __future__ import annotations

import torch

from retexo_fl.config import TrainConfig
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.runner import make_partitions


def _clients():
    cfg = TrainConfig.resolve(
        dataset="sbm:40,4,6,0.8", clients=40, method="node", seed=1, split="random:0.5,0.2,0.3"
    )
    parts = make_partitions(cfg)
    return LazyClient(parts[0], cfg), LazyClient(parts[1], cfg)


def _holds(model: torch.nn.Module, state: dict) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_a_shared_module_skips_only_a_load_it_already_holds(monkeypatch):
    a, b = _clients()
    state = {k: torch.randn_like(v) for k, v in a.make_model().state_dict().items()}
    loads = []
    load = torch.nn.Module.load_state_dict
    monkeypatch.setattr(
        torch.nn.Module, "load_state_dict", lambda m, s, *x, **y: loads.append(1) or load(m, s, *x, **y)
    )
    model = a.loaded_model(state)
    assert b.loaded_model(state) is model and len(loads) == 1  # the same state, untouched: no load
    # An optimizer step on the shared module: the next client gets the state, not the step.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(3, a.owned.shape[1]))[1].sum().backward()
    opt.step()
    assert not _holds(model, state)
    assert _holds(b.loaded_model(state), state) and len(loads) == 2
    # The state changed in place, or another state of equal values: loaded again.
    next(iter(state.values())).add_(1.0)
    assert _holds(a.loaded_model(state), state) and len(loads) == 3
    assert _holds(a.loaded_model(dict(state)), state) and len(loads) == 4
    # The same dict given a fresh tensor under a key whose old tensor was never changed in
    # place: the version counters are equal (0 and 0), the tensor is another.
    assert _holds(a.loaded_model(state), state) and len(loads) == 5
    key = list(state)[1]
    assert state[key]._version == 0
    state[key] = torch.randn_like(state[key])
    assert _holds(a.loaded_model(state), state) and len(loads) == 6
