"""Compression inside lazy training: accuracy holds at 8 bits, schedules and link budgets shape widths."""

from __future__ import annotations

import pytest
import torch

from retexo_fl.compress.boundary import BoundaryEncoder, parse_bandwidths
from retexo_fl.compress.quantize import CodecError
from retexo_fl.config import TrainConfig
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.training.lazy import run_lazy


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.resolve(
        **{"profile": "exact", "model": "gcn", "hidden": 16, "stages": 3, "rounds": 40, "seed": 0, **kw}
    )


def test_eight_bit_boundary_and_updates_keep_accuracy(sbm):
    parts = partition_graph(sbm, 4, "random", seed=0)
    full = run_lazy(parts, _cfg(hidden=64))
    small = run_lazy(parts, _cfg(hidden=64, bits=8, update_bits=8, broadcast_bits=8))
    assert small["test_accuracy"] >= full["test_accuracy"] - 0.03
    exchanged = sum(s["bytes_boundary_sent"] for s in small["stages"] if "bytes_boundary_sent" in s)
    assert exchanged <= 0.27 * small["bytes_boundary_raw"]
    # Both directions at 8 bits; each stage's first broadcast goes whole.
    assert small["bytes_model"] < 0.32 * small["bytes_model_raw"]
    assert full["bytes_model"] == full["bytes_model_raw"]


def test_linear_schedule_raises_widths_over_stages(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    out = run_lazy(parts, _cfg(stages=4, rounds=2, rate_schedule="linear:1,8"))
    hists = [s["bit_histogram"] for s in out["stages"][:-1]]
    assert [list(h) for h in hists] == [["1"], ["4"], ["8"]]  # rates 1, 4.5, 8 snapped down


def _bandwidth_exchange(sbm, budget: str, links: str):
    """Client 0's first boundary exchange under adaptive-bandwidth: its config, rows, frames, stats."""
    parts = partition_graph(sbm, 3, "random", seed=0)
    cfg = _cfg(bit_policy="adaptive-bandwidth", byte_budget=budget, link_bandwidths=links, encrypt=False)
    client = LazyClient(parts[0], cfg)
    rows = client.advance(torch.randn(parts[0].num_nodes, 16))
    return (parts, cfg, rows, *client.encode_boundary(rows))


def test_slow_links_get_fewer_bits(sbm):
    _, cfg, rows, frames, stats = _bandwidth_exchange(sbm, "6b", "0-1:1e5,0-2:3e5")
    per_value = {q: len(frames[q]) / rows[q].numel() for q in rows}
    assert per_value[1] < 0.6 * per_value[2]
    assert stats.bytes_sent <= BoundaryEncoder(cfg.compression)._budget(6.0, rows) + 1


def test_a_link_far_slower_than_the_others_gets_one_bit_and_the_rest_share_the_budget(sbm):
    """A link at a hundredth of the others' rate was given a hundredth of the time, below one bit
    a value, and the run failed at the first exchange (docs/compression.md's own command)."""
    from retexo_fl.compress.bits import one_bit_bytes

    parts, cfg, rows, frames, stats = _bandwidth_exchange(sbm, "4b", "1:1e5,default:1e7")
    budget = BoundaryEncoder(cfg.compression)._budget(4.0, rows)
    assert len(frames[1]) <= one_bit_bytes(*rows[1].shape)  # the floor, and no more
    assert stats.bytes_sent <= budget + 1  # the others took what the slow link could not
    assert len(frames[2]) > 0.9 * (budget - one_bit_bytes(*rows[1].shape))
    # Where even one bit a value on every link is past the budget, the error names the setting.
    tight = _cfg(
        bit_policy="adaptive-bandwidth", byte_budget="300", link_bandwidths="1:1e5,default:1e7", encrypt=False
    )
    with pytest.raises(
        CodecError, match=r"client 0, exchange -?\d+: a byte budget of 300 bytes .* raise byte-budget"
    ):
        LazyClient(parts[0], tight).encode_boundary(rows)


def test_nan_embeddings_are_refused_naming_client_and_exchange(sbm):
    parts = partition_graph(sbm, 3, "random", seed=0)
    client = LazyClient(parts[2], _cfg(bits=4))
    emb = torch.randn(parts[2].num_nodes, 16)
    emb[client.plan.send[0][0], 3] = float("nan")
    with pytest.raises(CodecError, match="client 2, exchange 0, rows to client 0"):
        client.encode_boundary(client.advance(emb))


def test_bandwidth_specs(tmp_path):
    assert parse_bandwidths("0:1e6, 1-2:5e5,default:1e9") == {"0": 1e6, "1-2": 5e5, "default": 1e9}
    f = tmp_path / "links.json"
    f.write_text('{"3": 2e6}')
    assert parse_bandwidths(str(f)) == {"3": 2e6}
    with pytest.raises(ValueError, match="non-numeric"):
        parse_bandwidths("0:fast")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_bandwidths("0:0")
    with pytest.raises(ValueError, match="adaptive-bandwidth needs link-bandwidths"):
        TrainConfig.resolve(profile="exact", bit_policy="adaptive-bandwidth").validate()
    with pytest.raises(ValueError, match=r"^bits must be one of 1, 2, 4, 8, 16, 32, got 3$"):
        TrainConfig.resolve(profile="exact", bits=3).validate()
    with pytest.raises(ValueError, match=r"^update-bits must be one of"):
        TrainConfig.resolve(profile="exact", update_bits=5).validate()
