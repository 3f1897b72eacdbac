"""The residency audit catches a real leaking ClientApp, once per encoding, in a Flower simulation.

The leaking ClientApp (``leaky_clientapp.py``) is the real one plus a mod that adds the client's
raw features, labels and edges to every reply in one field per encoding: scaled, shifted,
negated, transposed, flattened, with an extra column, as float16 and float64, labels one-hot,
as int32, floats, uint8 bytes, JSON and a metric list, edges as float64, past the first 16,
flattened, in local indices (the client's own LocalGraph edge_index too) and as a bitmap, labels
as a digit string, raw rows as float16 inside a frame and behind a forged envelope
prefix, and rows sealed to a peer (caught in the plaintext recorded before sealing).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.secure.audit import PLAINTEXT, check_audit

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_every_encoding_of_a_leak_is_caught(sbm, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    # Flower's simulation workers import the leaking app by name, as they import ours.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    import leaky_clientapp as leaky

    from server.simulation import simulate

    for p in partition_graph(sbm, 3, "metis", seed=0):
        save_partition(p, tmp_path / "parts" / f"part-{p.partition_id}")
    audit = tmp_path / "audit"
    cfg = TrainConfig.resolve(profile="exact",
        partitions=str(tmp_path / "parts"), clients=3, model="gcn", hidden=16, stages=2, rounds=2, seed=0,
        audit=str(audit),
    )  # fmt: skip
    simulate(cfg, client_app=leaky.app, work_dir=tmp_path / "work")
    _, findings = check_audit(audit)
    caught = {f.field.partition("::")[2] for f in findings if f.field.startswith("leak")}
    leaked = {*leaky.ARRAY_LEAKS, *leaky.CONFIG_LEAKS, *leaky.METRIC_LEAKS}
    assert leaked - caught == set(), f"not caught: {sorted(leaked - caught)}"
    sealed = [f for f in findings if f.field.startswith(PLAINTEXT) and "raw feature row" in f.what]
    assert sealed, "rows sealed to a peer were not caught in the plaintext recorded before sealing"
    # Nothing the real client sends is a finding: only the leaked fields are.
    assert {f.field.split("::")[0] for f in findings} <= {"leak-arrays", "leak", "leak-metrics", PLAINTEXT}
    clients = {f.client for f in findings}
    assert clients == {0, 1, 2}
