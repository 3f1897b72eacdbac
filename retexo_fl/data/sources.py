"""Where a dataset spec's files are, read without loading them: the ``files:`` spec's keys, and
each user file's size and modification time.

Light on purpose: a ClientApp's process keys its cached cut by these and imports no torch or PyG.
"""

from __future__ import annotations

from pathlib import Path

from retexo_fl.data.errors import DatasetError

#: The keys of a ``files:`` spec; ``edges``, ``features`` and ``labels`` are required.
FILE_KEYS = ("edges", "features", "labels", "id-column", "label-column")


class FileGraphError(DatasetError):
    """A plain graph file cannot be read; the message names the file (and line)."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")
        self.path, self.line, self.reason = str(path), line, reason

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None]]:
        # Rebuilt from its parts when unpickled (a worker process or a Ray actor raised it).
        return type(self), (self.path, self.reason, self.line)


def parse_files_spec(spec: str) -> dict[str, str]:
    """The ``key=value`` pairs after ``files:`` (``edges``, ``features``, ``labels`` required).

    Raises:
        FileGraphError: on an unknown or repeated key, a pair without ``=`` or a missing file key.
    """
    out: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise FileGraphError("--dataset", f"files: expected key=value, got {part!r}")
        if key not in FILE_KEYS:
            raise FileGraphError("--dataset", f"files: unknown key {key!r}; known: {', '.join(FILE_KEYS)}")
        if key in out:
            raise FileGraphError("--dataset", f"files: {key} given twice")
        out[key] = value.strip()
    missing = [k for k in ("edges", "features", "labels") if k not in out]
    if missing:
        raise FileGraphError(
            "--dataset",
            f"files: missing {', '.join(missing)} (use files:edges=E.csv,features=F.json,labels=L.csv)",
        )
    return out


def dataset_files(name: str) -> list[Path]:
    """The files a user's graph ``name`` is read from (a ``files:`` spec's three, an npz, a saved
    ``Data``); none for a named or generated dataset, whose files do not change under a name.

    A cut cached under the spec's text alone would outlive an edit of these files: a cache key
    adds their sizes and modification times (:func:`dataset_fingerprint`).
    """
    if name.startswith("files:"):
        keys = parse_files_spec(name[len("files:") :])
        return [Path(keys[k]) for k in ("edges", "features", "labels")]
    path = Path(name)
    if path.suffix.lower() in (".npz", ".pt", ".pth") or path.is_file():
        return [path]
    return []


def dataset_fingerprint(name: str) -> list[list[object]]:
    """``[path, size, mtime_ns]`` of each of :func:`dataset_files` (``None`` for a missing one:
    the load names it)."""
    out: list[list[object]] = []
    for path in dataset_files(name):
        try:
            st = path.stat()
        except OSError:
            out.append([str(path.resolve()), None, None])
            continue
        out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out
