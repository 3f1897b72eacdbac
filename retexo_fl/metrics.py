"""Run outputs: progress lines, a JSON-lines event log, ``summary.json`` and ``config.json``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

#: The file a resumable run (the Flower engines) keeps its progress in, in its run folder.
CHECKPOINT_FILE = "checkpoint.pt"


class RunRecorder:
    """Collects events of one run and writes them under ``out_dir`` (nothing is written if empty).

    Args:
        out_dir (str | Path | None, optional): the run folder; created at once. ``None`` or empty
            writes nothing. (default: :obj:`None`)
        stream (TextIO | str | None, optional): where progress lines go: ``"stderr"`` (looked up
            at each line so captured streams work), a text stream, or ``None`` for silence.
            (default: :obj:`"stderr"`)
        append (bool, optional): keep the folder's ``events.jsonl`` and add to it (a resumed run).
            (default: :obj:`False`)
    """

    def __init__(
        self, out_dir: str | Path | None = None, stream: TextIO | str | None = "stderr", append: bool = False
    ) -> None:
        self.out = Path(out_dir) if out_dir else None
        self._stream = stream
        self.t0 = time.perf_counter()
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            if not append or not (self.out / "events.jsonl").is_file():  # a resumed run keeps its events
                (self.out / "events.jsonl").write_text("")

    def elapsed(self) -> float:
        """Seconds since the recorder was made."""
        return time.perf_counter() - self.t0

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event to ``events.jsonl``, stamped with the elapsed time (no-op without a folder).

        Args:
            kind (str): the event's name (its ``event`` field).
            **fields (Any, optional): its other fields; arrays and tensors are written as lists.
        """
        if self.out:
            rec = {"t": round(self.elapsed(), 4), "event": kind, **fields}
            with open(self.out / "events.jsonl", "a") as f:
                f.write(json.dumps(rec, default=_jsonable) + "\n")

    def progress(self, line: str) -> None:
        """Print ``line`` to the progress stream, prefixed by the elapsed time (nothing when silent).

        Args:
            line (str): the progress line.
        """
        stream = sys.stderr if self._stream == "stderr" else self._stream
        if stream is not None:
            print(f"[{self.elapsed():7.1f}s] {line}", file=stream, flush=True)

    def write_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as indented JSON to ``out_dir / name``, atomically (no-op without a folder).

        Args:
            name (str): the file name, e.g. ``"summary.json"``.
            obj (Any): the content; arrays, tensors and paths are converted.
        """
        if self.out:
            tmp = self.out / (name + ".tmp")
            tmp.write_text(json.dumps(obj, indent=2, default=_jsonable))
            tmp.replace(self.out / name)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``"512 B"``, ``"1.50 KB"``, ... up to ``"GB"``.

    Args:
        n (float): a byte count.
    """
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"
