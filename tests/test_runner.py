"""The in-process runner: partitions read from files, and what it says about them."""

from __future__ import annotations

import io

from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph
from retexo_fl.metrics import RunRecorder
from retexo_fl.runner import make_partitions


def _written(sbm, tmp_path, clients: int, method: str):
    folder = tmp_path / method
    for p in partition_graph(sbm, clients, method, seed=0):
        save_partition(p, folder / f"part-{p.partition_id}")
    return folder


def _progress(cfg: TrainConfig) -> tuple[int, str]:
    out = io.StringIO()
    parts = make_partitions(cfg, RunRecorder(stream=out))
    return len(parts), out.getvalue()


def test_node_level_partition_files_not_declared_node_level_are_named(sbm, tmp_path):
    # The level's defaults are chosen from the settings (a deployed server reads no partition):
    # files cut one node each and trained without --method node would get the partitions'
    # defaults silently.
    node = _written(sbm, tmp_path, sbm.num_nodes, "node")
    count, said = _progress(TrainConfig.resolve(partitions=str(node)))
    assert count == sbm.num_nodes
    assert f"each of the {sbm.num_nodes} partitions holds one node" in said
    assert "--method node" in said

    # Declared, or not one node each, or not lazy: nothing to say.
    assert "holds one node" not in _progress(TrainConfig.resolve(partitions=str(node), method="node"))[1]
    assert "holds one node" not in _progress(TrainConfig.resolve(partitions=str(node), mode="eager"))[1]
    parts = _written(sbm, tmp_path, 4, "random")
    assert "holds one node" not in _progress(TrainConfig.resolve(partitions=str(parts)))[1]
