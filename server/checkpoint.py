"""Checkpoint files of lazy runs, and the configuration of a run to resume."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import torch

from retexo_fl import protocol as P
from retexo_fl.compress.boundary import ExchangeStats
from retexo_fl.compress.updates import ModelBroadcast, UpdateCodec
from retexo_fl.config import TrainConfig
from retexo_fl.coordinator.aggregate import ServerOptimizer
from retexo_fl.coordinator.checkpoint import Checkpoint, RoundState
from retexo_fl.coordinator.drift import ServerControl
from retexo_fl.coordinator.federation import ClientCounts
from retexo_fl.coordinator.privacy import UpdatePrivacy
from retexo_fl.coordinator.secure_aggregation import SecureAggregator
from retexo_fl.coordinator.selection import StageTracker
from retexo_fl.metrics import CHECKPOINT_FILE

#: The only classes a checkpoint file may name: plain data holders of this project. The file is
#: loaded with ``weights_only=True``, so anything else in it (a pickled callable, ``os.system``)
#: is refused instead of run: a checkpoint someone else could write is not code on the server.
SAFE_GLOBALS = [
    Checkpoint, RoundState, TrainConfig, ExchangeStats, ModelBroadcast, UpdateCodec, ServerOptimizer,
    StageTracker, ServerControl, UpdatePrivacy, SecureAggregator, ClientCounts, frozenset, set,
]  # fmt: skip
# The same classes by the names checkpoints written before the two wings (2026-11-27) pickled
# them under, so that such a run still resumes.
SAFE_GLOBALS += [
    (Checkpoint, "retexo_fl.training.checkpoint.Checkpoint"),
    (RoundState, "retexo_fl.training.checkpoint.RoundState"),
    (ServerOptimizer, "retexo_fl.training.aggregate.ServerOptimizer"),
    (StageTracker, "retexo_fl.training.selection.StageTracker"),
    (ServerControl, "retexo_fl.training.drift.ServerControl"),
    (UpdatePrivacy, "retexo_fl.training.privacy.UpdatePrivacy"),
    (SecureAggregator, "retexo_fl.training.secure_round.SecureAggregator"),
    (ClientCounts, "retexo_fl.training.federation.ClientCounts"),
]


class FileCheckpoints:
    """A :class:`~retexo_fl.coordinator.checkpoint.CheckpointStore` in a run folder.

    Args:
        folder (str): the run folder (``--out``).
    """

    def __init__(self, folder: str) -> None:
        self.path = Path(folder) / CHECKPOINT_FILE

    def save(self, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` atomically, readable by this user alone (it holds relayed frames)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
        tmp.replace(self.path)

    def load(self, mmap: bool = False) -> Checkpoint:
        """The checkpoint in the folder.

        Args:
            mmap (bool, optional): map its tensors from the file instead of reading them, for a
                reader of its small fields alone (a resume's config check). (default: :obj:`False`)

        Raises:
            ValueError: there is none, or the file is not a checkpoint.
        """
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no checkpoint to resume from (the run folder of a lazy run)")
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                checkpoint = torch.load(self.path, weights_only=True, mmap=mmap)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            lines = [
                line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line
            ]
            why = lines[0] if lines else type(exc).__name__
            raise ValueError(f"{self.path}: refused, not a checkpoint this server wrote ({why})") from None
        if not isinstance(checkpoint, Checkpoint):
            raise ValueError(f"{self.path}: not a checkpoint of this version ({type(checkpoint).__name__})")
        return checkpoint


def resumed_config(cfg: TrainConfig) -> TrainConfig:
    """The configuration of the run in ``cfg.resume``, set to resume it in that folder.

    A resumed run trains with the settings it started with, whatever else ``cfg`` sets, and
    writes on in its own folder.

    Raises:
        ValueError: ``cfg.resume`` is not a lazy run's folder or is a finished one's, its
            ``config.json`` was edited, or ``cfg`` names another run folder (``--out``), which
            the resumed run would never write.
    """
    if cfg.out_dir and Path(cfg.out_dir).resolve() != Path(cfg.resume).resolve():
        raise ValueError(
            f"--out {cfg.out_dir} with --resume {cfg.resume}: a resumed run continues in its own "
            "folder (leave --out out)"
        )
    path = Path(cfg.resume) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: not a run folder (no config.json); resume needs the --out of a lazy run")
    if (Path(cfg.resume) / "summary.json").is_file():  # resumed, its test would be sent again over it
        raise ValueError(
            f"{cfg.resume}: the run finished (summary.json): nothing to resume; its results stay as they are"
        )
    values = json.loads(path.read_text())
    values.pop("extra", None)
    # A setting newer than the run's config.json was not in force when it started: its field
    # default, not a mode's or level's default, so a resumed run trains as it began.
    started = dataclasses.asdict(TrainConfig())
    started.pop("extra")
    values = {**started, **values}
    try:
        resumed = TrainConfig.from_mapping({**values, "resume": str(cfg.resume), "out_dir": str(cfg.resume)})
    except ValueError as exc:  # the file was edited: say which file holds the bad setting
        raise ValueError(f"{path}: {exc}") from exc
    if resumed.mode != "lazy":
        raise ValueError(f"{cfg.resume}: resume continues lazy runs; this one is {resumed.mode}")
    _check_unedited(path, resumed, started)
    return resumed


def _check_unedited(path: Path, resumed: TrainConfig, defaults: dict) -> None:
    """Refuse a run's ``config.json`` (``path``) whose settings differ from those in its
    checkpoint, the config its clients bound at setup: they would refuse every message of the
    resumed run, after the engine had started, naming only two digests.

    ``defaults``: the field defaults, for settings the checkpoint's config predates. Without a
    checkpoint there is nothing to compare: the resume itself says so.
    """
    store = FileCheckpoints(str(path.parent))
    if not store.path.is_file():
        return
    try:
        began = store.load(mmap=True).config  # its small fields only: the frames stay in the file
    except ValueError:  # a file that cannot be mapped (older torch.save formats): read whole
        began = store.load().config

    def plain(values: dict) -> dict:  # as config.json holds them (tuples are lists there)
        return json.loads(json.dumps(values, default=str))

    before, now = plain({**defaults, **began}), plain(resumed.to_dict())
    changed = [
        name
        for name in sorted(before.keys() | now.keys())
        if name not in (*P.SERVER_ONLY_SETTINGS, "extra") and before.get(name) != now.get(name)
    ]
    if changed:
        what = ", ".join(
            f"{name.replace('_', '-')} {before.get(name)!r} -> {now.get(name)!r}" for name in changed
        )
        raise ValueError(
            f"{path}: edited since the run started ({what}); a resumed run trains with the settings "
            "its clients bound at setup: put them back, or start a new run with another --out"
        )
