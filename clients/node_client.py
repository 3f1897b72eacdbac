"""A node's client: built once per process and run, restored from node-local state, answering.

Ray actors serve several virtual nodes and keep Python state between messages; a node worker
(``retexo-fl supernode``) keeps it for the node's whole life; a deployed ClientApp without a
worker is a new process per message and falls back to the node-local work folder every time.

A node worker answers several runs at once, one thread per run (:mod:`clients.worker`), so the
cache here is guarded by a lock, and the worker holds a message's client (:func:`holding`) while
it answers and reads the audit target: one thread at a time per client, and a held client is
never dropped from the cache.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients.node import NodeView, cache_key, cut_lock
from clients.records import from_flower, to_flower
from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.data.partition import Partition, PartitionError, load_partition, save_partition
from retexo_fl.party.client import Client
from retexo_fl.party.eager_client import EagerClient
from retexo_fl.party.handlers import handle
from retexo_fl.party.lazy_client import LazyClient
from retexo_fl.secure.audit import AuditLog
from retexo_fl.secure.keys import private_folder
from retexo_fl.secure.policy import PolicyError

if TYPE_CHECKING:
    from torch_geometric.data import Data

#: (run key, node) -> its client, least recently used first.
_CACHE: dict[tuple[int, str], Client] = {}
#: How many runs' clients (by run key) a process keeps, least recently used dropped first when a
#: new one is built. One drops every earlier run's tensors; a node worker serving several runs at
#: once keeps one per run it serves (:data:`clients.worker.MAX_RUNS`), or they would evict each
#: other and reload their partition at every message.
CACHED_RUNS = 1
#: Set by the node worker: no other process writes this node's state, so a cached client that
#: this process loaded or answered with is current and is not loaded again before each message.
SOLE_WRITER = False
#: run key -> how many of its clients ``_CACHE`` holds (so that building a client does not walk
#: the cache, thousands of clients at one node per client, to find runs to drop).
_RUN_SIZES: dict[int, int] = {}
#: (run key, node) -> the version of the saved state its cached client holds (``None``: unknown).
#: Ray actors (several serve one virtual node, one message at a time) cannot tell two writes in
#: a row apart by file times, which are too coarse: each save names a new version in the node's
#: Flower context (:data:`STATE_VERSION_RECORD`), which the engine hands with the node's next
#: message to whichever actor serves it. A process whose client holds that version skips the
#: load: at one node per client, loading was half of a simulated client's time (Cora, 2,708).
_CURRENT: dict[tuple[int, str], str | None] = {}
#: The ``context.state`` record naming the version of the node's saved client state.
STATE_VERSION_RECORD = "retexo-fl-state"
#: (run key, node) -> the node's view of the last message its client answered (audit_target).
_VIEWS: dict[tuple[int, str], NodeView] = {}
#: Guards ``_CACHE``, ``_VIEWS``, ``_CURRENT`` and ``_HELD``: a node worker answers runs on several threads.
_LOCK = threading.Lock()


class _Hold:
    """One client's lock, and how many threads hold it or wait for it (:func:`holding`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


#: (run key, node) -> its hold, while a thread holds or waits for that client.
_HELD: dict[tuple[int, str], _Hold] = {}


@contextmanager
def holding(msg: Message, context: Context) -> Iterator[tuple[int, str]]:
    """Hold the message's client (its run key and node) for the ``with`` block.

    The run key is the server's to name, so two runs' threads in a node worker may name one
    client: they take turns here, as a client's state must not change under two threads at
    once. A held client is not dropped from the cache, so :func:`audit_target` after
    :func:`answer` reads the client that answered, even while other runs build theirs.

    Args:
        msg (Message): the message about to be answered.
        context (Context): its context (the node config names the node).

    Yields:
        tuple[int, str]: the client's (run key, node).

    Raises:
        KeyError: the message carries no config (as :func:`answer` would).
        ValueError: its run key is not an integer.
    """
    key = cache_key(msg, context)
    with _LOCK:
        hold = _HELD.setdefault(key, _Hold())
        hold.users += 1
    try:
        with hold.lock:
            yield key
    finally:
        with _LOCK:
            hold.users -= 1
            if not hold.users:
                del _HELD[key]


def forget(run_keys: Iterable[int]) -> None:
    """Drop the cached clients of these runs (not a held one): a node worker whose run has gone
    quiet gives its memory back. A run that sends again restores its client from its work folder.

    Args:
        run_keys (Iterable[int]): the run keys whose clients to drop.
    """
    runs = set(run_keys)
    with _LOCK:
        held = {run for run, _ in _HELD}
        for key in [k for k in _CACHE if k[0] in runs and k[0] not in held]:
            _uncache(key)


def _cache(key: tuple[int, str], client: Client, view: NodeView | None) -> None:
    """Keep one client, most recently used. The caller holds ``_LOCK``; ``_CACHE`` changes only
    here and in :func:`_uncache`, which keep ``_RUN_SIZES`` with it."""
    if key not in _CACHE:
        _RUN_SIZES[key[0]] = _RUN_SIZES.get(key[0], 0) + 1
    _CACHE[key] = client
    if view is not None:
        _VIEWS[key] = view


def _uncache(key: tuple[int, str]) -> None:
    """Drop one cached client. The caller holds ``_LOCK``."""
    del _CACHE[key]
    _VIEWS.pop(key, None)
    _CURRENT.pop(key, None)
    left = _RUN_SIZES.pop(key[0], 0) - 1
    if left > 0:
        _RUN_SIZES[key[0]] = left


def _drop_old_runs(keep: int) -> None:
    """Drop clients of the least recently used runs beyond :data:`CACHED_RUNS`, never run
    ``keep``'s (the one just built) nor a held one's. The caller holds ``_LOCK``.

    Args:
        keep (int): the run key of the client just built.
    """
    if len(_RUN_SIZES) <= CACHED_RUNS:  # nothing to drop: no walk over thousands of clients
        return
    held = {run for run, _ in _HELD}
    runs = [run for run in dict.fromkeys(run for run, _ in _CACHE) if run != keep]  # oldest first
    for run in runs[: max(0, len(runs) - (CACHED_RUNS - 1))]:
        if run in held:  # another thread is answering with it: dropped when a later client is built
            continue
        for key in [k for k in _CACHE if k[0] == run]:
            _uncache(key)


def load_node_partition(view: NodeView, work: Path) -> Partition:
    """This node's partition: loaded and validated, or (simulation) this run's cached cut."""
    cfg, part_dir = view.cfg, view.partition
    if view.given_partition:
        try:
            part = load_partition(part_dir, stamp=work / "partition-verified.json")
        except PartitionError as exc:
            if P.NODE_PARTITION_DIR not in view.node_config:  # the command line's --partitions
                raise
            raise _without_local_path(exc, part_dir) from None
        if part.num_partitions != cfg.clients:  # else a peer's missing key would be the first sign
            raise ValueError(
                f"{view.who}: this node's partition is part {part.partition_id} of a "
                f"{part.num_partitions}-client cut, and the run config says clients={cfg.clients}"
            )
        return part
    # Simulation: the first node to find no cut writes every part of one; the others load theirs.
    # Each node cutting for itself is not enough: two Ray actors' cuts of one graph have been seen
    # to number its parts differently (METIS, 2026-11-24), and the boundary plans then disagree.
    with cut_lock(part_dir.parent, exclusive=False):
        if (part_dir / "manifest.json").is_file():
            return load_partition(part_dir, stamp=work / "partition-verified.json")
    with cut_lock(part_dir.parent, exclusive=True):
        if not (part_dir / "manifest.json").is_file():
            write_cut(cfg, part_dir.parent)
        return load_partition(part_dir, stamp=work / "partition-verified.json")


def _without_local_path(exc: PartitionError, part_dir: Path) -> PartitionError:
    """``exc`` naming its file within the party's ``partition-dir``: the error reaches the
    coordinator, and where the party keeps its data (``/data/clinic-a/patients/...``) is the
    party's own. Its node's start names the whole path, in the party's own log."""
    try:
        inside = Path(exc.path).resolve().relative_to(Path(part_dir).resolve())
    except ValueError:
        inside = Path(Path(exc.path).name)
    return PartitionError(Path("partition-dir") / inside, exc.field, exc.reason)


def write_cut(cfg: TrainConfig, folder: Path, graph: Data | None = None) -> None:
    """Cut ``cfg``'s dataset (``graph`` if loaded already) and write every part into ``folder``.

    The caller holds ``folder``'s exclusive :func:`~clients.node.cut_lock`.
    """
    # Imported here: PyG's dataset and utility modules cost seconds, and a deployed ClientApp
    # (a new process per message) never cuts a dataset.
    from retexo_fl.data.loading import load_graph
    from retexo_fl.data.partitioners import partition_graph

    graph = graph if graph is not None else load_graph(cfg)
    for part in partition_graph(graph, cfg.clients, cfg.method, seed=cfg.seed):
        save_partition(part, folder / f"part-{part.partition_id}")


def node_client(view: NodeView, context: Context) -> tuple[Client, Path]:
    """This node's client for the message's run, restored to its saved state, and its work folder.

    Args:
        view (NodeView): what the node knows of itself for this message.
        context (Context): the message's context (it names the saved state's version).

    Raises:
        PolicyError: the message's run config is weaker than this party's policy, or is not the
            one this client was set up with.
    """
    cfg, policy, key = view.cfg, view.policy, view.key
    # Every message: a server may send a weaker config to a client it already set up.
    policy.check(cfg, view.who)
    work = private_folder(view.work)  # it holds the client's keys and state
    with _LOCK:
        client = _CACHE.pop(key, None)
        if client is not None:
            _CACHE[key] = client  # most recently used last
            _VIEWS[key] = view
    if client is None:
        # Built outside the lock (a partition load takes seconds): other runs go on meanwhile.
        part = load_node_partition(view, work)
        if cfg.mode in ("eager", "local"):
            client = EagerClient(part, cfg, local=cfg.mode == "local", policy=policy)
        else:
            client = LazyClient(part, cfg, policy)
        if policy.audit_dir:  # frames sealed for peers are audited as plaintext, before sealing
            log = AuditLog(policy.audit_dir, client.id, str(view.partition), cfg.encrypt)
            client.channel.observer = log.record_sealed
        with _LOCK:
            _cache(key, client, view)
            _CURRENT.pop(key, None)  # a new client holds nothing yet: restored below
            _drop_old_runs(key[0])  # earlier runs' tensors
    # Another Ray actor may have advanced this node since, or this is a restarted worker: the
    # saved state is the truth, unless this process is its only writer and already holds it.
    version = state_version(context)
    if not holds_current(key, version):
        client.restore(work)
        with _LOCK:
            _CURRENT[key] = version
    # Set up with one config, a client takes no other: rebuilt, it has this message's, so a
    # refused one is not kept for the next message to find (it would train by that config).
    try:
        client.check_run_config(cfg)
        if client.cfg is not cfg:  # a cached client built from an earlier message's config
            client.check_run_config(client.cfg)
    except PolicyError:
        with _LOCK:
            if _CACHE.get(key) is client:
                _uncache(key)
        raise
    return client, work


def holds_current(key: tuple[int, str], version: str | None) -> bool:
    """Whether this process's cached client of ``key`` holds the node's saved state: as the node
    worker, the only writer, whenever it is cached; else when it holds the ``version`` the
    node's context names (see :data:`_CURRENT`)."""
    with _LOCK:
        if key not in _CURRENT:
            return False
        return SOLE_WRITER or (version is not None and _CURRENT[key] == version)


def state_version(context: Context) -> str | None:
    """The version of the node's saved client state its Flower context names (``None``: none)."""
    record = context.state.get(STATE_VERSION_RECORD)
    return None if record is None else str(record["version"])


def saved(context: Context, key: tuple[int, str]) -> None:
    """The node's client state was just saved: name a new version in its context, held here."""
    version = secrets.token_hex(8)
    context.state[STATE_VERSION_RECORD] = ConfigRecord({"version": version})
    with _LOCK:
        _CURRENT[key] = version


def cached_client(msg: Message, context: Context) -> Client:
    """The client :func:`node_client` built for this message (the audit mod reads it)."""
    return _CACHE[cache_key(msg, context)]


def answer(msg: Message, context: Context) -> RecordDict:
    """This node's reply content to ``msg``: restore the client, let the library's handler
    answer, and save the node-local state when the answer changed it."""
    client, work = node_client(NodeView.of(msg, context), context)
    try:
        reply = handle(client, msg.metadata.message_type, from_flower(msg.content))
    except Exception:
        with _LOCK:
            _CURRENT.pop(cache_key(msg, context), None)  # a half-applied message: reload the saved state
        raise
    if reply.changed:
        client.save(work)  # node-local: the private key and stage inputs stay in this folder
        saved(context, cache_key(msg, context))
    return to_flower(reply.records)


def audit_target(msg: Message, context: Context) -> dict | None:
    """Where and as whom this node records its replies (its policy's audit folder: node config
    ``audit-dir``, never the server's run config), or None when it does not, or when no client
    was built for this message (a failure before that loaded none of the client's data). The
    handler has just built or restored the client: it and the node's view of the message are read
    from the cache, not built again."""
    try:
        key = cache_key(msg, context)
        client, view = _CACHE[key], _VIEWS[key]
    except (KeyError, TypeError, ValueError):
        return None
    folder = client.policy.audit_dir
    if not folder:
        return None
    encrypted = client.channel.enabled
    return {
        "folder": str(folder),
        "client": client.id,
        "partition": str(view.partition),
        "encrypted": encrypted,
    }
