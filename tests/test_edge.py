"""profile=edge: chunked embeddings give the same rows and keep a client's peak memory under its ceiling."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import save_partition

#: The stated ceiling (docs/deployment.md): a client with profile=edge computing a 64-wide GCN stage over a
#: 40,000-node partition with about 2,000,000 edges stays under this peak RSS.
EDGE_CEILING_MB = 900

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from retexo_fl.config import TrainConfig
    from retexo_fl.data.partition import load_partition
    from retexo_fl.party.lazy_client import LazyClient
    part = load_partition(sys.argv[1])
    cfg = TrainConfig.resolve(**json.loads(sys.argv[2]))
    client = LazyClient(part, cfg)
    # Stage 1 of a lone client (no halo rows), through the client's own interface.
    client.advance(torch.randn(part.num_nodes, 64, generator=torch.Generator().manual_seed(0)))
    client.receive_degrees({})
    client.receive_halo({})
    state = client.make_model().state_dict()
    def high_water_mb():
        # VmHWM is this address space's own peak. ru_maxrss is not: exec keeps the peak of the
        # address space it replaces, which after subprocess's vfork is pytest's own.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    before = high_water_mb()
    out = client.embeddings(state)
    peak = high_water_mb()
    torch.save(out[:500].clone(), sys.argv[3])
    print(json.dumps({"peak_mb": peak, "before_mb": before}))
    """
)


def test_edge_profile_defaults():
    cfg = TrainConfig.resolve(profile="edge")
    assert (cfg.device, cfg.threads, cfg.chunk_rows) == ("cpu", 1, 4096)
    assert (cfg.bits, cfg.update_bits, cfg.broadcast_bits) == (8, 4, 4)  # model deltas are 4-bit by default
    assert TrainConfig.resolve(profile="edge", bits=4, chunk_rows=100).bits == 4  # what the user set stays
    set_ = {"bits": 32, "update_bits": 32, "threads": 0, "chunk_rows": 0, "device": "auto"}
    given = TrainConfig.resolve(profile="edge", **set_)
    assert {k: getattr(given, k) for k in set_} == set_  # a profile never replaces a setting given
    assert TrainConfig.from_mapping(TrainConfig.resolve(profile="edge").to_dict()).chunk_rows == 4096
    with pytest.raises(ValueError, match="profile"):
        TrainConfig.resolve(profile="phone").validate()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc (Linux)")
def test_edge_client_stays_under_its_memory_ceiling(tmp_path):
    import torch

    from retexo_fl.data.datasets import apply_split, synthetic_sbm
    from retexo_fl.data.partitioners import partition_graph

    data = synthetic_sbm(40_000, 4, avg_degree=50, homophily=0.8, num_features=8, seed=0)
    apply_split(data, "random:0.1,0.1,0.8", seed=0)
    part = partition_graph(data, 1, "random", seed=0)[0]
    assert part.edges.shape[1] > 1_900_000
    save_partition(part, tmp_path / "part-0")
    del data, part

    def run(settings: dict) -> tuple[float, np.ndarray]:
        out = tmp_path / f"rows-{len(settings)}.pt"
        # Max-SAGE passes messages over the edge list, one row per edge, which chunking bounds;
        # GCN and mean-SAGE multiply by a CSR matrix and materialize no per-edge rows at all.
        cfg = {"model": "sage-max", "hidden": 64, "stages": 2, **settings}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / "part-0"), json.dumps(cfg), str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"], torch.load(out)

    edge_peak, edge_rows = run({"profile": "edge"})
    full_peak, full_rows = run({"device": "cpu", "threads": 1})
    print(f"peak RSS: edge {edge_peak:.0f} MB, all rows at once {full_peak:.0f} MB")
    assert torch.allclose(edge_rows, full_rows, atol=1e-5)  # the same embeddings
    assert edge_peak < EDGE_CEILING_MB, f"edge client peaked at {edge_peak:.0f} MB"
    assert full_peak > edge_peak + 300, (full_peak, edge_peak)  # chunking is what keeps it down


@pytest.mark.parametrize("model", ["gcn", "sage-max", "gat"])
def test_rows_in_chunks_train_evaluate_and_embed_as_all_at_once(sbm, model):
    """``chunk-rows``: a conv stage's step, evaluation and embeddings, a few rows at a time (the
    step's dropout masks replayed for every chunk), equal those computed all at once."""
    import torch

    from retexo_fl.data.partitioners import partition_graph
    from retexo_fl.party.lazy_client import LazyClient

    part = partition_graph(sbm, 1, "random", seed=0)[0]
    stage_input = torch.randn(part.num_nodes, 12, generator=torch.Generator().manual_seed(0))

    def client(chunk: int) -> LazyClient:
        c = LazyClient(part, TrainConfig(model=model, hidden=8, stages=2, chunk_rows=chunk, local_epochs=3))
        c.advance(stage_input)
        c.receive_degrees({})
        c.receive_halo({})
        return c

    whole, chunked = client(0), client(37)
    assert int(whole.masks["train"].sum()) > 3 * 37  # several chunks
    state = whole.make_model().state_dict()
    torch.testing.assert_close(chunked.embeddings(state), whole.embeddings(state))
    a, b = chunked.evaluate(state, "val"), whole.evaluate(state, "val")
    assert (a.correct, a.count) == (b.correct, b.count) and a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5)
    new_a, loss_a = chunked.train(state, 1)
    new_b, loss_b = whole.train(state, 1)
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for k in new_b:  # three steps with dropout: the same masks, or the weights would part
        torch.testing.assert_close(new_a[k], new_b[k], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(new_b[k], state[k]) for k in state)  # the step moved the weights
