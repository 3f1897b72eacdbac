"""A node's client: built once per process and run, restored from node-local state, answering.

Ray actors serve several virtual nodes and keep Python state between messages; a node worker
(``retexo-fl supernode``) keeps it for the node's whole life; a deployed ClientApp without a
worker is a new process per message and falls back to the node-local work folder every time.
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import Context, Message, RecordDict

from clients.node import cache_key, partition_dir, run_config, work_dir
from clients.records import from_flower, to_flower
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition, load_partition, save_partition
from retexo_fl.training.client import Client
from retexo_fl.training.eager_client import EagerClient
from retexo_fl.training.handlers import handle
from retexo_fl.training.lazy_client import LazyClient
from retexo_fl.training.state import STATE_FILE

_CACHE: dict[tuple[int, str], Client] = {}
#: (run key, node) -> the state file's (mtime, size) when this process last wrote or read it: a
#: client whose file is unchanged since is current and is not loaded again.
_STAMPS: dict[tuple[int, str], tuple[int, int] | None] = {}


def _stamp(work: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(work / STATE_FILE)
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def load_node_partition(context: Context, cfg: TrainConfig, work: Path) -> Partition:
    """This node's partition: loaded and validated, or (simulation) cut from the dataset and kept."""
    part_dir = partition_dir(context, cfg)
    given = P.NODE_PARTITION_DIR in context.node_config or cfg.partitions
    if given or (part_dir / "manifest.json").is_file():
        return load_partition(part_dir, stamp=work / "partition-verified.json")
    # Simulation: every virtual node cuts the same dataset deterministically and keeps its part.
    # Imported here: PyG's dataset and utility modules cost seconds, and a deployed ClientApp
    # (a new process per message) never cuts a dataset.
    from retexo_fl.data.loading import load_graph
    from retexo_fl.data.partitioners import partition_graph

    pid = int(context.node_config[P.NODE_PARTITION_ID])
    parts = partition_graph(load_graph(cfg), cfg.clients, cfg.method, seed=cfg.seed)
    save_partition(parts[pid], part_dir)
    return parts[pid]


def node_client(msg: Message, context: Context) -> tuple[Client, Path]:
    """This node's client for the message's run, restored to its saved state, and its work folder."""
    cfg = run_config(msg, context)
    key = cache_key(msg, context)
    work = work_dir(context, *key)
    client = _CACHE.get(key)
    if client is None:
        part = load_node_partition(context, cfg, work)
        if cfg.mode in ("eager", "local"):
            client = EagerClient(part, cfg, local=cfg.mode == "local")
        else:
            client = LazyClient(part, cfg)
        for old in [k for k in _CACHE if k[0] != key[0]]:  # drop earlier runs' tensors
            del _CACHE[old]
            _STAMPS.pop(old, None)
        _CACHE[key] = client
    # Another Ray actor may have advanced this node since, or this is a restarted worker: the
    # saved state is the truth whenever it changed after this process last saw it.
    stamp = _stamp(work)
    if stamp is None or _STAMPS.get(key) != stamp:
        client.restore(work)
        _STAMPS[key] = stamp
    return client, work


def cached_client(msg: Message, context: Context) -> Client:
    """The client :func:`node_client` built for this message (the audit mod reads it)."""
    return _CACHE[cache_key(msg, context)]


def answer(msg: Message, context: Context) -> RecordDict:
    """This node's reply content to ``msg``: restore the client, let the library's handler
    answer, and save the node-local state when the answer changed it."""
    client, work = node_client(msg, context)
    identity = str(context.node_config.get(P.NODE_IDENTITY_KEY, ""))
    reply = handle(client, msg.metadata.message_type, from_flower(msg.content), identity)
    if reply.changed:
        client.save(work)  # node-local: the private key and stage inputs stay in this folder
        _STAMPS[cache_key(msg, context)] = _stamp(work)
    return to_flower(reply.records)


def audit_target(msg: Message, context: Context) -> dict | None:
    """Where and as whom this node records its replies (``audit`` in the run config, or node
    config ``audit-dir``), or None when it does not. The handler has just built or restored the
    client: it is read from the cache, not restored again."""
    client = cached_client(msg, context)
    folder = context.node_config.get(P.NODE_AUDIT_DIR) or client.cfg.audit
    if not folder:
        return None
    partition = str(partition_dir(context, client.cfg))
    encrypted = client.cfg.encrypt
    return {"folder": str(folder), "client": client.id, "partition": partition, "encrypted": encrypted}
