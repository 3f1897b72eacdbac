"""The run summary: what every mode's training returns, and what ``summary.json`` holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunSummary(Mapping[str, Any]):
    r"""One run's result, whatever its mode; :meth:`to_dict` is ``summary.json``.

    Every mode writes the fields in the first group. The federated modes add the per-client
    rows, the compression figures and the federation's entries; a lazy run adds which stage it
    delivers. Figures that belong to one mode only (the data-center products' per-epoch bytes,
    eager's local steps per round) go in ``extra``. It reads as a mapping too
    (``summary["test_accuracy"]``), by the keys of ``summary.json``.

    Args:
        mode (str): the training mode (``lazy``, ``eager``, ``local``, ``centralized``,
            ``datacenter``).
        engine (str): what ran it (``in-process``, ``simulation``, ``deployment``,
            ``torch.distributed``).
        test_accuracy (float, optional): the delivered model's test accuracy (``None``: the
            split has no test nodes).
        val_accuracy (float): its validation accuracy (what chose it).
        bytes_total (int): every byte the run sent (boundary, model, secure aggregation).
        bytes_boundary (int): boundary (halo) bytes.
        bytes_model (int): model bytes, both directions.
        stages (list[dict], optional): one entry per lazy stage, per centralized self-training
            pass, or the eager / local run's one stage: rounds, best round, bytes and the
            validation history. (default: :obj:`[]`)
        wall_seconds (float, optional): the run's wall-clock time. (default: :obj:`0.0`)
        config (dict, optional): the run's settings (:meth:`TrainConfig.to_dict`).
            (default: :obj:`{}`)
        clients (list[dict] | None, optional): each client's test figures (federated modes;
            empty under secure aggregation, where the server learns sums only).
            (default: :obj:`None`)
        bytes_boundary_raw (int | None, optional): boundary bytes before compression.
            (default: :obj:`None`)
        bytes_model_raw (int | None, optional): model bytes before compression.
            (default: :obj:`None`)
        bit_histogram (dict[str, int] | None, optional): boundary rows sent per bit width.
            (default: :obj:`None`)
        kept_stage (int | None, optional): the stage whose model a lazy run delivers.
            (default: :obj:`None`)
        kept_pass (int | None, optional): its self-training pass (lazy; centralized with passes).
            (default: :obj:`None`)
        kept_variant (str | None, optional): set when the delivered model is a stage-0 lane that
            no later stage was trained on (``sprint``: ``first-stage-sprint``). (default: :obj:`None`)
        stage_results (list[dict] | None, optional): every lazy stage's validation and test
            accuracy, and whether it was measured on the same clients as the last.
            (default: :obj:`None`)
        passes (list[dict] | None, optional): the rows of ``stage_results`` that end a pass.
            (default: :obj:`None`)
        resumed (bool | None, optional): whether a lazy run continued from a checkpoint.
            (default: :obj:`None`)
        federation (dict, optional): the federation's entries: lost clients, missing payloads,
            messages sent by type (``{"train": 1280, ...}``, one per client each), privacy
            spent, secure aggregation, transport figures. (default: :obj:`{}`)
        extra (dict, optional): the mode's own figures. (default: :obj:`{}`)
    """

    mode: str
    engine: str
    test_accuracy: float | None
    val_accuracy: float
    bytes_total: int
    bytes_boundary: int
    bytes_model: int
    stages: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    clients: list[dict[str, Any]] | None = None
    bytes_boundary_raw: int | None = None
    bytes_model_raw: int | None = None
    bit_histogram: dict[str, int] | None = None
    kept_stage: int | None = None
    kept_pass: int | None = None
    kept_variant: str | None = None
    stage_results: list[dict[str, Any]] | None = None
    passes: list[dict[str, Any]] | None = None
    resumed: bool | None = None
    federation: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``summary.json``: every field set (``None`` ones left out), the federation's entries
        and ``extra`` at the top level, as one flat object."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in _NESTED:
                continue
            value = getattr(self, f.name)
            if value is not None or f.name == "test_accuracy":  # null: no test nodes
                out[f.name] = value
        out.update(self.federation)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunSummary:
        """Read a summary written by :meth:`to_dict` (``summary.json``): the keys that are not
        fields go to ``extra``.

        Raises:
            ValueError: naming the required keys that are missing.
        """
        names = {f.name for f in dataclasses.fields(cls)} - _NESTED
        missing = [f.name for f in dataclasses.fields(cls) if f.name in _REQUIRED and f.name not in values]
        if missing:
            raise ValueError(f"a run summary needs {', '.join(missing)}")
        known = {k: v for k, v in values.items() if k in names}
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)

    def without_test(self) -> None:
        """Mark the run as having no test nodes (a split with a test share of 0): no test
        accuracy, here or in any stage's row, where the engines computed 0 (or NaN) over none."""
        self.test_accuracy = None
        for rows in (self.stages, self.stage_results or []):
            for row in rows:
                if "test_accuracy" in row:
                    row["test_accuracy"] = None

    def accuracy_text(self) -> str:
        """The test accuracy as a progress line shows it (``-`` without test nodes)."""
        return "- (no test nodes)" if self.test_accuracy is None else f"{self.test_accuracy:.4f}"

    def line(self) -> str:
        """The run's last progress line: test and validation accuracy, bytes, seconds."""
        return (
            f"test accuracy {self.accuracy_text()}  val {self.val_accuracy:.4f}  "
            f"bytes boundary {self.bytes_boundary}  model {self.bytes_model}  in {self.wall_seconds:.1f}s"
        )

    # -- read as a mapping, by summary.json's keys ---------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


#: Fields whose entries :meth:`RunSummary.to_dict` writes at the top level.
_NESTED = frozenset({"federation", "extra"})
#: Fields without a default: every summary has them.
_REQUIRED = frozenset(
    f.name
    for f in dataclasses.fields(RunSummary)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
