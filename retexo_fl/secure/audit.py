"""Residency audit: every message a client sends, recorded at the client, and the checker that reads them.

The checker proves, message by message, that no array a client sent holds one of its raw
feature rows, its label vector or its edge list, in any dtype-faithful form (a tensor row,
a run of bytes inside a frame), and that every boundary payload the server relayed was
sealed (:mod:`retexo_fl.secure.envelope`), so the server only ever held ciphertext.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retexo_fl.data.partition import Partition, load_partition
from retexo_fl.secure.envelope import ENVELOPE_BYTES, MAGIC

#: Feature rows searched for inside byte payloads (the array check covers every row).
SAMPLE_ROWS = 512
_SEP = "::"


class AuditLog:
    """Append-only record of the messages one client sends.

    Args:
        root (str | Path): the audit folder; this client writes ``root/client-<id>/``.
        client_id (int): the client.
        partition (str): the partition folder the checker compares against.
        encrypted (bool): whether the run sealed its payloads (then a plaintext payload is a
            finding).
    """

    def __init__(self, root: str | Path, client_id: int, partition: str, encrypted: bool) -> None:
        self.dir = Path(root) / f"client-{client_id}"
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.dir / "client.json"
        if not info.is_file():
            info.write_text(json.dumps({"client": client_id, "partition": partition, "encrypted": encrypted}))

    def record(self, message_type: str, records: dict[str, dict[str, Any]]) -> Path:
        """Write one outgoing message: ``{record name: {key: array | bytes | value}}``.

        Arrays and byte strings go into ``<seq>-<type>.npz``, everything else into the JSON beside it.

        Args:
            message_type (str): the message type (e.g. ``"train"``).
            records (dict[str, dict[str, Any]]): the message's records.

        Returns:
            The message's path without suffix (``.json`` and ``.npz`` hold it).
        """
        seq = len(list(self.dir.glob("*.json"))) - 1
        stem = self.dir / f"{seq:05d}-{message_type.replace('.', '-')}"
        arrays, values = {}, {}
        for rname, rec in records.items():
            for key, value in rec.items():
                name = f"{rname}{_SEP}{key}"
                if isinstance(value, np.ndarray):
                    arrays[name] = value
                elif isinstance(value, bytes | bytearray | memoryview):
                    arrays[name] = np.frombuffer(bytes(value), dtype=np.uint8)
                    values[name] = "<bytes>"
                else:
                    values[name] = value
        np.savez(stem.with_suffix(".npz"), **{f"a{i}": a for i, a in enumerate(arrays.values())})
        stem.with_suffix(".json").write_text(
            json.dumps({"type": message_type, "arrays": list(arrays), "values": values}, default=str)
        )
        return stem


@dataclass(frozen=True)
class Finding:
    """One thing a client sent that it must not have.

    Args:
        client (int): the client.
        message (str): the message's file stem (sequence number and type).
        field (str): the field, as ``record::key``.
        what (str): what it held, in words.
    """

    client: int
    message: str
    field: str
    what: str

    def __str__(self) -> str:
        return f"client {self.client}, message {self.message}, {self.field}: {self.what}"


def _messages(folder: Path) -> Iterator[tuple[str, dict]]:
    for meta_path in sorted(folder.glob("[0-9]*.json")):
        meta = json.loads(meta_path.read_text())
        with np.load(meta_path.with_suffix(".npz"), allow_pickle=False) as z:
            arrays = {name: z[f"a{i}"] for i, name in enumerate(meta["arrays"])}
        yield meta_path.stem, {"meta": meta, "arrays": arrays}


class _Secrets:
    """What one client must keep: its feature rows, labels and edges, in searchable forms."""

    def __init__(self, part: Partition) -> None:
        x = np.ascontiguousarray(part.x, dtype=np.float32)
        self.num_features = x.shape[1]
        # Rows with fewer than two nonzeros (all-zero rows, one-hot rows) occur by chance in any
        # array; a match on them proves nothing.
        informative = x[(x != 0).sum(1) >= 2]
        self.rows = {r.tobytes() for r in informative}
        rng = np.random.default_rng(0)
        pick = rng.choice(len(informative), min(SAMPLE_ROWS, len(informative)), replace=False)
        self.row_bytes = [informative[i].tobytes() for i in pick]
        y = np.asarray(part.y, dtype=np.int64)
        self.labels = [y] + [y[np.asarray(m)] for m in (part.train_mask, part.val_mask, part.test_mask)]
        self.labels = [v for v in self.labels if v.size >= 8]
        c = np.asarray(part.cross_edges).reshape(-1, 4)
        pairs = np.concatenate([np.asarray(part.edges).T, c[:, :2]])
        self.edges = {(int(a), int(b)) for a, b in pairs} | {(int(b), int(a)) for a, b in pairs}
        self.edge_bytes = [
            np.ascontiguousarray(e).tobytes()
            for e in (np.asarray(part.edges)[:, :16], np.asarray(part.edges)[:, :16].T, c[:16, :2])
            if e.size >= 16
        ]

    def check_array(self, arr: np.ndarray) -> str | None:
        if arr.dtype == np.uint8:  # a byte payload (frame, envelope, JSON): look inside it
            blob = arr.tobytes()
            if any(r in blob for r in self.row_bytes):
                return "contains a raw feature row (float32 bytes)"
            if any(v.tobytes() in blob for v in self.labels):
                return "contains the label vector (int64 bytes)"
            if any(e in blob for e in self.edge_bytes):
                return "contains the edge list (int64 bytes)"
            return None
        if arr.dtype.kind == "f" and arr.ndim >= 1 and arr.shape[-1] == self.num_features:
            rows = np.ascontiguousarray(arr.reshape(-1, self.num_features), dtype=np.float32)
            if any(r.tobytes() in self.rows for r in rows):
                return "holds a raw feature row"
        if arr.dtype.kind in "iuf" and arr.ndim == 1:
            for v in self.labels:
                if arr.size == v.size and np.array_equal(arr.astype(np.float64), v.astype(np.float64)):
                    return "is the label vector"
        if arr.dtype.kind in "iu" and arr.size >= 8 and 2 in arr.shape and arr.ndim == 2:
            pairs = arr.T if arr.shape[0] == 2 else arr
            hits = sum((int(a), int(b)) in self.edges for a, b in pairs)
            if hits >= max(4, len(pairs) // 2):
                return f"is an edge list ({hits} of {len(pairs)} pairs are this client's edges)"
        return None


def check_audit(
    root: str | Path, partitions: str | Path | None = None
) -> tuple[dict[int, dict], list[Finding]]:
    """Check every client folder under ``root``; returns per-client figures and every finding.

    Args:
        root (str | Path): the audit folder (``client-<id>/`` sub-folders).
        partitions (str | Path | None, optional): a folder of ``part-<id>/`` to compare against,
            instead of the partition each client recorded. (default: :obj:`None`)

    Returns:
        ``(figures, findings)``: ``{client: {"messages", "arrays", "payloads", "partition"}}`` and
        the list of :class:`Finding`.

    Raises:
        FileNotFoundError: if ``root`` holds no ``client-*`` folder.
    """
    root = Path(root)
    folders = sorted(root.glob("client-*"))
    if not folders:
        raise FileNotFoundError(f"{root}: no client-* audit folders (was the run started with audit?)")
    figures, findings = {}, []
    for folder in folders:
        info = json.loads((folder / "client.json").read_text())
        cid = int(info["client"])
        where = Path(partitions) / f"part-{cid}" if partitions else Path(info["partition"])
        secrets = _Secrets(load_partition(where))
        n_msgs = n_arrays = n_payloads = 0
        for name, msg in _messages(folder):
            n_msgs += 1
            for field, arr in msg["arrays"].items():
                n_arrays += 1
                what = secrets.check_array(arr)
                if what:
                    findings.append(Finding(cid, name, field, what))
                if field.partition(_SEP)[0] == "payloads":
                    n_payloads += 1
                    blob = arr.tobytes()
                    if info["encrypted"] and (len(blob) < ENVELOPE_BYTES or not blob.startswith(MAGIC)):
                        findings.append(Finding(cid, name, field, "boundary payload relayed in plaintext"))
        figures[cid] = {
            "messages": n_msgs,
            "arrays": n_arrays,
            "payloads": n_payloads,
            "partition": str(where),
        }
    return figures, findings
