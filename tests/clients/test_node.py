"""A node keeps the run config setup brought, in a work folder of its own, and refuses others."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from clients.node import WORK_DIR_ENV, run_config, work_base
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.federation import FederationView
from retexo_fl.metrics import RunRecorder
from retexo_fl.training.inprocess import InProcessTransport


@dataclass
class _Metadata:
    message_type: str
    run_id: int = 1


@dataclass
class _Message:
    """What ``run_config`` reads of a message (a real ``Message`` needs a running Flower context)."""

    content: dict
    metadata: _Metadata


@dataclass
class _Context:
    node_config: dict = field(default_factory=dict)
    node_id: int = 5


def _federation(**kw) -> FederationView:
    return FederationView(InProcessTransport([]), TrainConfig.resolve(**kw), RunRecorder(None, stream=None))


def _message(fed: FederationView, kind: str, **kw) -> _Message:
    """The message ``fed`` would send, as the ClientApp sees its records."""
    return _Message(fed.content(**kw), _Metadata(kind))


def test_a_node_keeps_the_config_setup_brought(tmp_path):
    fed = _federation(hidden=16, rounds=[60, 200])
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: 2})
    assert run_config(_message(fed, P.SETUP), ctx).to_dict() == fed.cfg.to_dict()
    got = run_config(_message(fed, P.TRAIN, by_digest=True, round=1), ctx)
    assert got.hidden == 16 and got.rounds == [60, 200]
    assert got.to_dict() == fed.cfg.to_dict()
    assert (tmp_path / f"run-{fed.run_key}" / "node-2" / "run-config.json").is_file()


def test_a_train_message_for_an_unknown_or_other_config_is_refused(tmp_path):
    fed = _federation(hidden=16)
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: 2})
    train = _message(fed, P.TRAIN, by_digest=True, round=1)
    with pytest.raises(ValueError, match=r"holds none for run key .*missed key setup and setup"):
        run_config(train, ctx)
    other = _federation(hidden=32)
    other.run_key = fed.run_key  # the same run key, another config: a stale or forged message
    run_config(_message(other, P.SETUP), ctx)
    with pytest.raises(
        ValueError, match=r"names run config '[0-9a-f]{32}'; this node holds '[0-9a-f]{32}'"
    ) as err:
        run_config(train, ctx)
    assert str(tmp_path) not in str(err.value)  # the reply goes to the server: no node path in it
    # A run config that does not parse is refused before anything of it is kept on the node.
    forged = _message(fed, P.SETUP)
    forged.content[P.CONFIG][P.RUN] = "cos\nsystem\n(S'true'\ntR."  # a pickle, not a config
    forged.content[P.CONFIG][P.RUN_KEY] = fed.run_key + 1
    with pytest.raises(ValueError):
        run_config(forged, ctx)
    assert not list(tmp_path.glob(f"run-{fed.run_key + 1}/*/run-config.json"))


def test_the_work_folder_is_the_nodes_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "env"))
    assert work_base(_Context()) == tmp_path / "env"
    assert work_base(_Context({P.NODE_WORK_DIR: str(tmp_path / "node")})) == tmp_path / "node"
    monkeypatch.delenv(WORK_DIR_ENV)
    assert work_base(_Context()).name == "retexo-fl"


def test_simulated_nodes_load_their_parts_of_one_cut(tmp_path, monkeypatch):
    """Three virtual nodes (threads here; Ray actors in a simulation) cut a graph whose parts each
    cut would number its own way: they still load disjoint parts of one cut, so their boundary
    plans agree. Each node cutting for itself, as before, fails the plan check."""
    import threading

    import numpy as np

    from clients.node import NodeView, cut_folder
    from clients.node_client import load_node_partition
    from retexo_fl.data import partitioners
    from retexo_fl.data.loading import load_graph
    from retexo_fl.plan import BoundaryPlan, PlanMismatchError, check_plans

    calls: list[int] = []

    def renumbering_cut(data, nparts, method="metis", seed=0, **options):
        """The real cut, with its parts numbered differently on every call."""
        calls.append(1)
        owner = (partitioners.assign_nodes(data, nparts, method, seed) + len(calls)) % nparts
        return partitioners.split_graph(data, owner, nparts, method=method, seed=seed)

    monkeypatch.setattr(partitioners, "partition_graph", renumbering_cut)
    cfg = TrainConfig(dataset="sbm:300,3", clients=3, method="metis", seed=0)
    parts, errors = {}, []

    def node(pid: int) -> None:
        try:
            ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: pid}, node_id=pid)
            view = NodeView.for_run(ctx, cfg, (0, str(pid)))  # type: ignore[arg-type]
            parts[pid] = load_node_partition(view, tmp_path / f"work-{pid}")
        except Exception as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(pid,)) for pid in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(calls) == 1  # one node cut, and wrote every part
    assert sorted(p.partition_id for p in parts.values()) == [0, 1, 2]
    ids = np.concatenate([p.node_ids for p in parts.values()])
    assert np.array_equal(np.sort(ids), np.arange(300))
    check_plans({pid: BoundaryPlan.from_partition(p).digests() for pid, p in parts.items()})
    # A node finding a cut without its part (a writer killed mid-way) cuts again, whole.
    folder = cut_folder(tmp_path, cfg)
    for name in ("manifest.json", "x.npy"):
        (folder / "part-2" / name).unlink()
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path), P.NODE_PARTITION_ID: 2}, node_id=2)
    again = load_node_partition(NodeView.for_run(ctx, cfg, (0, "2")), tmp_path / "work-2b")  # type: ignore[arg-type]
    assert len(calls) == 2 and again.partition_id == 2
    # The old way, each node cutting for itself, numbers the parts differently: the check fails.
    graph = load_graph(cfg)
    own = {pid: renumbering_cut(graph, 3, cfg.method, cfg.seed)[pid] for pid in range(3)}
    with pytest.raises(PlanMismatchError):
        check_plans({pid: BoundaryPlan.from_partition(p).digests() for pid, p in own.items()})


def test_a_release_budget_is_counted_where_the_node_keeps_it_or_refused(tmp_path, monkeypatch):
    """A deployed party's release budget lives in a ledger under its work base, keyed by its
    partition; under the temp default it would start again after a reboot, so it is refused."""
    from clients.node import RELEASE_LEDGER, NodeView
    from retexo_fl.secure.policy import PolicyError

    monkeypatch.delenv(WORK_DIR_ENV, raising=False)
    cfg = TrainConfig.resolve(boundary_clip=1.0, boundary_noise=2.0)
    part = tmp_path / "part-0"
    budget = {P.NODE_PARTITION_DIR: str(part), P.NODE_MAX_BOUNDARY_EPSILON: "10"}
    kept = _Context({**budget, P.NODE_WORK_DIR: str(tmp_path / "work")})
    policy = NodeView.for_run(kept, cfg, (7, "0")).policy
    assert policy.release_ledger == str(tmp_path / "work" / RELEASE_LEDGER)
    assert policy.release_key == str(part.resolve())
    with pytest.raises(
        PolicyError, match=r"max-boundary-epsilon: the budget is counted in a ledger .* temp folder"
    ):
        _ = NodeView.for_run(_Context(budget), cfg, (7, "0")).policy
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "env"))  # named by the environment: kept
    assert NodeView.for_run(_Context(budget), cfg, (7, "0")).policy.release_ledger.startswith(
        str(tmp_path / "env")
    )
    # A simulation's virtual node (an id, the command line's policy): counted per run, no ledger.
    assert NodeView.for_run(_Context({P.NODE_PARTITION_ID: 0}), cfg, (7, "0")).policy.release_ledger == ""


def test_a_cut_of_a_users_files_is_not_found_again_after_they_change(tmp_path):
    """A node finding a cut uses it: keyed on the spec's text alone, a cut of the files before an
    edit trained the next run of the same spec (new nodes and classes unseen)."""
    import os

    from clients.node import cut_folder, partition_dir

    (tmp_path / "e.csv").write_text("s,t\n0,1\n1,2\n")
    (tmp_path / "f.csv").write_text("id,a\n0,1\n1,2\n2,3\n")
    (tmp_path / "l.csv").write_text("id,y\n0,a\n1,b\n2,a\n")
    spec = f"files:edges={tmp_path / 'e.csv'},features={tmp_path / 'f.csv'},labels={tmp_path / 'l.csv'}"
    cfg = TrainConfig(dataset=spec, split="random:0.34,0.33,0.33", clients=2, method="random")
    first = cut_folder(tmp_path / "work", cfg)
    assert cut_folder(tmp_path / "work", cfg) == first  # every node of a run finds the same cut
    assert cut_folder(tmp_path / "work", TrainConfig(**{**cfg.to_dict(), "seed": 1})) != first
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path / "work"), P.NODE_PARTITION_ID: 1}, node_id=1)
    in_run = partition_dir(ctx, cfg, run_key=7)  # type: ignore[arg-type]
    assert in_run == first / "part-1"
    stat = (tmp_path / "l.csv").stat()
    (tmp_path / "l.csv").write_text("id,y\n0,a\n1,a\n2,a\n")  # same size, one class merged
    os.utime(tmp_path / "l.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cut_folder(tmp_path / "work", cfg) != first
    # Within a run the cut stays the one it began with (a client rebuilt mid-run would have cut
    # the edited files again); the next run takes the edit.
    assert partition_dir(ctx, cfg, run_key=7) == in_run  # type: ignore[arg-type]
    assert partition_dir(ctx, cfg, run_key=8) != in_run  # type: ignore[arg-type]
    assert cut_folder(tmp_path / "work", TrainConfig(dataset="sbm:300,3")) == cut_folder(
        tmp_path / "work", TrainConfig(dataset="sbm:300,3")
    )


def test_a_broken_partition_is_reported_without_where_the_party_keeps_it(tmp_path, sbm):
    """The error reaches the coordinator: it names the file within the party's partition-dir and
    the field, not the party's own folders."""
    from clients.node import NodeView
    from clients.node_client import load_node_partition
    from retexo_fl.data.partition import PartitionError, save_partition
    from retexo_fl.data.partitioners import partition_graph

    folder = save_partition(partition_graph(sbm, 2, "random")[0], tmp_path / "clinic-a" / "part-0")
    (folder / "x.npy").write_bytes((folder / "x.npy").read_bytes()[:-64])
    ctx = _Context({P.NODE_WORK_DIR: str(tmp_path / "work"), P.NODE_PARTITION_DIR: str(folder)})
    view = NodeView.for_run(ctx, TrainConfig(clients=2), (0, "0"))  # type: ignore[arg-type]
    with pytest.raises(PartitionError) as err:
        load_node_partition(view, tmp_path / "work" / "run")
    assert err.value.path == "partition-dir/x.npy" and err.value.field == "checksum"
    assert "clinic-a" not in str(err.value) and str(tmp_path) not in str(err.value)
