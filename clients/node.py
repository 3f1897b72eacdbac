"""Where a node keeps things: its work folders, its partition, the run config it was sent.

All of these are node-local settings (node config, or the environment), never the server's.
Nothing here imports torch: a ClientApp shim that forwards to a node worker uses it too. The
node's client itself is :mod:`clients.node_client`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message

from retexo_fl import protocol as P
from retexo_fl.config import TrainConfig
from retexo_fl.data.sources import dataset_fingerprint
from retexo_fl.secure.keys import private_folder

if TYPE_CHECKING:
    from retexo_fl.secure.policy import PartyPolicy

#: Environment variable naming the default base of node work folders (else the temp folder):
#: lets a test or a shared host keep one run's node state apart from every other's.
WORK_DIR_ENV = "RETEXO_FL_WORK_DIR"
#: The file under a node's work base that counts its boundary releases over every run
#: (:class:`~retexo_fl.secure.boundary_noise.ReleaseLedger`).
RELEASE_LEDGER = "boundary-releases.json"


def default_work_base() -> Path:
    """The base of node work folders where no node config names one: ``$RETEXO_FL_WORK_DIR``, or
    ``<temp>/retexo-fl``."""
    base = os.environ.get(WORK_DIR_ENV)
    return Path(base) if base else Path(tempfile.gettempdir()) / "retexo-fl"


def work_base(context: Context) -> Path:
    """The base of this node's work folders: node config ``work-dir``, else
    :func:`default_work_base`."""
    base = context.node_config.get(P.NODE_WORK_DIR)
    return Path(str(base)) if base else default_work_base()


def work_dir(context: Context, run_key: int, slot: str) -> Path:
    """This node's work folder in run ``run_key``."""
    return work_base(context) / f"run-{run_key}" / f"node-{slot}"


def who(context: Context) -> str:
    """How errors name this node: its client id, or its partition folder's name (the errors reach
    the server: the node's own paths stay on the node)."""
    if P.NODE_PARTITION_ID in context.node_config:
        return f"client {context.node_config[P.NODE_PARTITION_ID]}"
    folder = context.node_config.get(P.NODE_PARTITION_DIR)
    return f"client at {Path(str(folder)).name}" if folder else f"client at node {context.node_id}"


def partition_dir(context: Context, cfg: TrainConfig, run_key: int | None = None) -> Path:
    """Where this node's partition lives: given, written earlier, or the cached cut of run
    ``run_key`` (the user's files as this process first saw them in that run)."""
    if P.NODE_PARTITION_DIR in context.node_config:
        return Path(str(context.node_config[P.NODE_PARTITION_DIR]))
    pid = int(context.node_config[P.NODE_PARTITION_ID])
    if cfg.partitions:  # simulation over partitions written earlier by `retexo-fl partition`
        return Path(cfg.partitions) / f"part-{pid}"
    fingerprint = None
    if run_key is not None:
        # Once a run: a client rebuilt later in it (evicted, reloaded) finds the same cut even if
        # the files were touched since, rather than cutting them again mid-run.
        key = (run_key, cfg.dataset)
        if key not in _RUN_FINGERPRINTS:  # not on every message: the files are stat-ed once
            _RUN_FINGERPRINTS[key] = dataset_fingerprint(cfg.dataset)
        fingerprint = _RUN_FINGERPRINTS[key]
    return cut_folder(work_base(context), cfg, fingerprint) / f"part-{pid}"


#: (run key, dataset) -> the user's files' fingerprint as this process first saw it in that run.
_RUN_FINGERPRINTS: dict[tuple[int, str], list[list[object]]] = {}


def cut_folder(base: Path, cfg: TrainConfig, fingerprint: list[list[object]] | None = None) -> Path:
    """Where a simulation keeps the cut of ``cfg``'s dataset under the work base ``base``: one
    folder per (dataset, split, partitioning, clients, seed), holding every ``part-<i>``, and
    per version of a user's graph files (their sizes and modification times): a cut of files
    since edited is not found again (``fingerprint``: theirs as given, else as they are now)."""
    key = json.dumps(
        [
            *(cfg.dataset, cfg.split, cfg.split_index, cfg.method, cfg.clients, cfg.seed),
            *(dataset_fingerprint(cfg.dataset) if fingerprint is None else fingerprint),
        ]
    )
    return base / "partitions" / hashlib.sha256(key.encode()).hexdigest()[:16]


@contextmanager
def cut_lock(folder: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``folder``'s lock: exclusive to write a cut, shared to read one.

    The virtual nodes of a simulation run in several processes, and all of them must use one cut:
    a node that finds none cuts the whole graph and writes every part under the exclusive lock,
    and no node reads a part while another process (re)writes the cut.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_key(msg: Message) -> int:
    """The server's key for this run: it outlives Flower's run id when a run is resumed."""
    return int(msg.content[P.CONFIG].get(P.RUN_KEY, msg.metadata.run_id))


def cache_key(msg: Message, context: Context) -> tuple[int, str]:
    """(run key, node) of this node's client in this run: its cache slot and work folder."""
    return run_key(msg), str(context.node_config.get(P.NODE_PARTITION_ID, context.node_id))


def run_config(msg: Message, context: Context) -> TrainConfig:
    """The run config: in the message, or, for a train message that names it by digest, the one
    the node kept from an earlier message of this run (in its work folder: a deployed ClientApp
    is a new process per message).

    Raises:
        ValueError: a digest this node holds no config for, or another config's.
    """
    config = msg.content[P.CONFIG]
    path = work_dir(context, *cache_key(msg, context)) / "run-config.json"
    if P.RUN in config:
        text = str(config[P.RUN])
        parsed = P.config_from_json(text)  # before it is kept: nothing unparsed lands on the node
        if not path.is_file() or path.read_text() != text:
            private_folder(path.parent)  # the work folder: it will hold the client's keys
            path.with_suffix(".tmp").write_text(text)
            path.with_suffix(".tmp").replace(path)
        return parsed
    digest = str(config.get(P.RUN_DIGEST, ""))
    if not path.is_file():
        raise ValueError(
            f"a {msg.metadata.message_type} message names run config {digest!r}, "
            f"but this node holds none for run key {run_key(msg)} (it missed key setup and setup)"
        )
    text = path.read_text()
    if P.config_digest(text) != digest:  # the reply goes to the server: no path of the node's
        raise ValueError(
            f"a {msg.metadata.message_type} message names run config {digest!r}; "
            f"this node holds {P.config_digest(text)!r}"
        )
    return P.config_from_json(text)


@dataclass
class NodeView:
    """What this node knows of itself while it answers one message, built once per message
    (:meth:`of`) from its node config and the message, never from the server's run config alone.

    Args:
        node_config (dict): the node config.
        key (tuple[int, str]): (run key, node): the node's cache slot and work folder in the run.
        who (str): how errors name this node.
        cfg (TrainConfig): the run config the message carries or names.
        work (Path): the node-local work folder of this run (it holds the client's keys and state).
        partition (Path): where this node's partition lives.
    """

    node_config: dict[str, Any]
    key: tuple[int, str]
    who: str
    cfg: TrainConfig
    work: Path
    partition: Path

    @classmethod
    def of(cls, msg: Message, context: Context) -> NodeView:
        """The view for ``msg``.

        Raises:
            ValueError: the message names a run config this node does not hold (see
                :func:`run_config`).
        """
        return cls.for_run(context, run_config(msg, context), cache_key(msg, context))

    @classmethod
    def for_run(cls, context: Context, cfg: TrainConfig, key: tuple[int, str]) -> NodeView:
        """The view of a node of ``context`` in the run of ``cfg`` and ``key``."""
        return cls(
            node_config=dict(context.node_config),
            key=key,
            who=who(context),
            cfg=cfg,
            work=work_dir(context, *key),
            partition=partition_dir(context, cfg, key[0]),
        )

    @property
    def given_partition(self) -> bool:
        """The partition was given (node config, or partitions written earlier), not cut here."""
        return P.NODE_PARTITION_DIR in self.node_config or bool(self.cfg.partitions)

    @cached_property
    def policy(self) -> PartyPolicy:
        """This party's security policy: its node config (or, in simulation, the command line's)."""
        # Imported here: the policy's noise accounting imports torch, which a shim never loads.
        from retexo_fl.secure.policy import PartyPolicy

        policy = PartyPolicy.from_node_config(self.node_config, self.who)
        # A deployed party's release budget is the node's over every run: the run key that names
        # a run's work folder is the server's to choose, so a count kept there would start again
        # with a new one. A party is deployed when its node config names its partition folder or
        # its own budget; a simulation's virtual nodes (a partition id, the command line's
        # policy) count per run.
        if P.NODE_PARTITION_DIR in self.node_config:
            key = str(Path(self.partition).resolve())
        elif P.NODE_MAX_BOUNDARY_EPSILON in self.node_config:
            # Named by id, the partition's folder may come from the run config (the server's):
            # the id is the node's own.
            key = f"partition-id {self.node_config.get(P.NODE_PARTITION_ID, '?')}"
        else:
            return policy
        if math.isfinite(policy.max_boundary_epsilon) and not self._kept_work_base:
            from retexo_fl.secure.policy import PolicyError

            raise PolicyError(
                self.who,
                P.NODE_MAX_BOUNDARY_EPSILON,
                "the budget is counted in a ledger under the node's work folder, which is under the "
                f"temp folder unless the node config names one ({P.NODE_WORK_DIR}) or "
                f"${WORK_DIR_ENV} does; name one that outlives a reboot, or the budget would start again",
            )
        ledger = Path(self.work).parent.parent / RELEASE_LEDGER
        return replace(policy, release_ledger=str(ledger), release_key=key)

    @property
    def _kept_work_base(self) -> bool:
        """Whether this node's work base was named (node config or environment), not the temp default."""
        return P.NODE_WORK_DIR in self.node_config or bool(os.environ.get(WORK_DIR_ENV))
