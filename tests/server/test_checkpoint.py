"""A checkpoint file is data, not code: a crafted one is refused before anything in it runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from retexo_fl.coordinator.aggregate import ServerOptimizer
from server.checkpoint import CHECKPOINT, FileCheckpoints


class _RunsCode:
    """What someone who can write the run folder would leave there: unpickling it runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / CHECKPOINT, "wb") as f:
        torch.save({"stage": 1, "payload": _RunsCode(str(marker))}, f)
    with pytest.raises(ValueError, match=r"refused, not a checkpoint this server wrote \(.*posix.system"):
        FileCheckpoints(str(tmp_path)).load()
    assert not marker.exists()
    # the same file, loaded the way the server once did, would have run it
    torch.load(tmp_path / CHECKPOINT, weights_only=False)
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
