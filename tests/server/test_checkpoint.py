"""A checkpoint file is data, not code: a crafted one is refused before anything in it runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from retexo_fl.coordinator.aggregate import ServerOptimizer
from retexo_fl.metrics import CHECKPOINT_FILE
from server.checkpoint import SAFE_GLOBALS, FileCheckpoints


class _RunsCode:
    """What someone who can write the run folder would leave there: unpickling it runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / CHECKPOINT_FILE, "wb") as f:
        torch.save({"stage": 1, "payload": _RunsCode(str(marker))}, f)
    with pytest.raises(ValueError, match=r"refused, not a checkpoint this server wrote \(.*posix.system"):
        FileCheckpoints(str(tmp_path)).load()
    assert not marker.exists()
    # the same file, loaded the way the server once did, would have run it
    torch.load(tmp_path / CHECKPOINT_FILE, weights_only=False)
    assert marker.exists()


def test_fedadams_moments_survive_a_weights_only_round_trip(tmp_path):
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    opt = ServerOptimizer("adam", state, lr=0.1)
    for _ in range(3):
        opt.step({k: v + 0.5 for k, v in state.items()})
    back = pickle.loads(pickle.dumps(opt))  # what torch.save stores: __getstate__'s plain dict
    path = tmp_path / "opt.pt"
    torch.save(opt, path)
    with torch.serialization.safe_globals([ServerOptimizer]):
        loaded = torch.load(path, weights_only=True)
    target = {k: v - 0.2 for k, v in state.items()}
    expected = opt.step(target)
    for other in (back, loaded):
        got = other.step(target)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_checkpoint_written_before_the_two_wings_still_loads(tmp_path, monkeypatch):
    """Checkpoints pickled their classes under ``retexo_fl.training.*`` until the party and
    coordinator wings (2026-11-27): such a run folder still resumes."""
    import sys
    import types

    from retexo_fl.coordinator import aggregate

    state = {"w": torch.randn(2, 2)}
    opt = ServerOptimizer("adam", state, lr=0.1)
    old = types.ModuleType("retexo_fl.training.aggregate")
    old.ServerOptimizer = ServerOptimizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "retexo_fl.training.aggregate", old)
    monkeypatch.setattr(ServerOptimizer, "__module__", "retexo_fl.training.aggregate")
    with open(tmp_path / CHECKPOINT_FILE, "wb") as f:
        torch.save({"server": opt}, f)
    assert b"retexo_fl.training.aggregate" in (tmp_path / CHECKPOINT_FILE).read_bytes()
    monkeypatch.undo()  # the old module is gone again, as in a fresh process
    assert ServerOptimizer.__module__ == aggregate.__name__
    # What FileCheckpoints.load allows (a whole Checkpoint of that time is checked the same way).
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        loaded = torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)
    assert isinstance(loaded["server"], ServerOptimizer)
    # Without the old names the same file is refused, so the list above is what loads it.
    current = [g for g in SAFE_GLOBALS if not isinstance(g, tuple)]
    with pytest.raises(pickle.UnpicklingError), torch.serialization.safe_globals(current):
        torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)
