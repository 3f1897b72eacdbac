"""The residency audit passes on a real federated run and catches a client that leaks."""

from __future__ import annotations

import numpy as np
import pytest

from retexo_fl.cli import main
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.secure.audit import AuditLog, check_audit
from retexo_fl.secure.envelope import MAGIC


@pytest.fixture
def parts_dir(sbm, tmp_path):
    parts = partition_graph(sbm, 3, "metis", seed=0)
    for p in parts:
        save_partition(p, tmp_path / "parts" / f"part-{p.partition_id}")
    return tmp_path / "parts", parts


@pytest.mark.slow
def test_audit_passes_on_a_federated_run(parts_dir, tmp_path, capsys):
    from server.simulation import simulate

    root, _ = parts_dir
    audit = tmp_path / "audit"
    cfg = TrainConfig.resolve(
        profile="exact",
        partitions=str(root),
        clients=3,
        model="gcn",
        hidden=16,
        stages=3,
        rounds=3,
        seed=0,
        audit=str(audit),
    )
    simulate(cfg)
    figures, findings = check_audit(audit)
    assert findings == []
    assert sorted(figures) == [0, 1, 2]
    for f in figures.values():
        # hello, setup, 3 stages x (3 train rounds + evaluations), 2 embeds: every one recorded
        assert f["messages"] >= 2 + 3 * 3 + 2
        assert f["payloads"] >= 3  # degrees and two boundary exchanges, all sealed
        assert f["sealed_plaintexts"] >= 3  # ... and each recorded before sealing, and checked
    assert main(["audit", str(audit)]) == 0
    assert "audit passed: 0 finding(s)" in capsys.readouterr().out


def test_audit_catches_a_leaking_client(parts_dir, tmp_path, capsys):
    root, parts = parts_dir
    p = parts[1]
    x, y = np.asarray(p.x, dtype=np.float32), np.asarray(p.y)
    rich = int(np.flatnonzero((x != 0).sum(1) >= 2)[0])
    audit = tmp_path / "audit"
    log = AuditLog(audit, 1, str(root / "part-1"), encrypted=True)
    rng = np.random.default_rng(0)
    clean = {
        "arrays": {"mlp.weight": rng.standard_normal((16, x.shape[1])).astype(np.float32)},
        "payloads": {"to-0": MAGIC + rng.bytes(200)},
        "metrics": {"num-examples": 12, "train-loss": 0.5},
    }
    log.record("train", clean)
    weights = rng.standard_normal((16, x.shape[1])).astype(np.float32)
    weights[7] = x[rich]
    log.record("train", {"arrays": {"mlp.weight": weights}})  # a feature row hidden in a model
    log.record("query.embed", {"payloads": {"to-2": b"RXQ1" + x[rich].tobytes()}})  # raw row in a frame
    log.record("evaluate", {"arrays": {"labels": y.copy()}})
    log.record("query.setup", {"arrays": {"edges": np.asarray(p.edges)[:, :40].copy()}})

    _, findings = check_audit(audit)
    got = {(f.message, f.field, f.what.split(" (")[0]) for f in findings}
    assert got == {
        ("00001-train", "arrays::mlp.weight", "holds 1 raw feature row(s)"),
        ("00002-query-embed", "payloads::to-2", "holds 1 raw feature row(s)"),
        ("00002-query-embed", "payloads::to-2", "boundary payload relayed in plaintext"),
        ("00003-evaluate", "arrays::labels", "holds the label vector"),
        ("00004-query-setup", "arrays::edges", "is an edge list"),
    }
    assert main(["audit", str(audit)]) == 1
    out = capsys.readouterr().out
    assert "LEAK client 1, message 00001-train, arrays::mlp.weight: holds 1 raw feature row(s)" in out
    assert "audit FAILED: 5 finding(s)" in out


def test_an_error_reply_is_audited_like_any_other(parts_dir, tmp_path):
    """A failure's reason is text that leaves the node: the audit mod records it (here on the
    node-worker path, where the worker names the audit target with its error)."""
    from flwr.app import Context, Error, Message, Metadata, RecordDict

    from clients import shim
    from clients.mods import audit_messages, report_errors
    from retexo_fl import protocol as P

    root, parts = parts_dir
    y = np.asarray(parts[2].y)
    meta = Metadata(
        run_id=1, message_id="m-1", src_node_id=0, dst_node_id=3, reply_to_message_id="", group_id="",
        created_at=0.0, ttl=60.0, message_type="evaluate",
    )  # fmt: skip
    msg = Message(content=RecordDict(), metadata=meta)
    context = Context(
        run_id=1, node_id=3, node_config={P.NODE_WORKER: "/nowhere"}, state=RecordDict(), run_config={}
    )
    target = {
        "folder": str(tmp_path / "audit"),
        "client": 2,
        "partition": str(root / "part-2"),
        "encrypted": True,
    }

    def failing(m: Message, c: Context) -> Message:
        shim._AUDIT[m.metadata.message_id] = target  # what the worker's error header said
        raise ValueError("labels " + "".join(str(v) for v in y.tolist()))  # data in a reason

    reply = audit_messages(msg, context, lambda m, c: report_errors(m, c, failing))
    assert reply.has_error() and isinstance(reply.error, Error)
    _, findings = check_audit(tmp_path / "audit")
    assert [(f.field, f.what) for f in findings] == [
        ("error::reason", "holds the label vector as digits in text")
    ]


def test_audit_in_process_is_refused_with_a_message(tmp_path, capsys):
    argv = ["train", "--dataset", "sbm:100,2", "--clients", "2", "--audit", str(tmp_path / "audit")]
    assert main(argv) == 2
    assert (
        "--audit records what each ClientApp sends, and the in-process engine runs none"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "audit").exists()
