"""Residency audit: every message a client sends, recorded at the client, and the checker that reads them.

A client records each reply as it leaves the ClientApp, and each frame it seals for a peer as
plaintext, before sealing (so what peers get is audited too, not only what the server sees).
The checker searches every recorded value (arrays, bytes, strings, lists of numbers) for the
client's raw feature rows, label vectors and edges with :class:`~retexo_fl.secure.detect.SecretFinder`:
every row, and re-encodings of them (scaled, shifted, transposed, flattened, re-typed, one-hot,
bitmap, in bytes at any offset, in text). It also checks that every boundary payload the server
relayed was sealed. What it proves is exactly that: none of those encodings of the client's own
raw data is in what it sent. It does not prove that nothing can be inferred from what was sent
(embeddings and updates are functions of the data: ``bench/inversion.py`` measures that).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retexo_fl.data.partition import load_partition
from retexo_fl.secure.detect import SecretFinder, flatten_values
from retexo_fl.secure.envelope import ENVELOPE_BYTES, MAGIC

_SEP = "::"
#: The record name of frames recorded before sealing (file stems ``sealed-<seq>-<kind>``).
PLAINTEXT = "plaintext"


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
        seq = len(list(self.dir.glob("[0-9]*.json")))
        return self._write(self.dir / f"{seq:05d}-{message_type.replace('.', '-')}", message_type, records)

    def record_sealed(self, kind: str, stage: int, round_: int, dst: int, frame: bytes) -> Path:
        """Write one frame as it was before sealing for peer ``dst`` (the channel calls this).

        Args:
            kind (str): the payload kind (``"deg"``, ``"halo"``, ``"eager"``).
            stage (int): the stage it was sealed in.
            round_ (int): the round it was sealed in.
            dst (int): the peer it is for.
            frame (bytes): the plaintext.

        Returns:
            The record's path without suffix.
        """
        seq = len(list(self.dir.glob("sealed-*.json")))
        records = {PLAINTEXT: {f"to-{dst}": bytes(frame)}, "route": {"stage": stage, "round": round_}}
        return self._write(self.dir / f"sealed-{seq:05d}-{kind}", f"sealed {kind}", records)

    def _write(self, stem: Path, message_type: str, records: dict[str, dict[str, Any]]) -> Path:
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
    for meta_path in sorted([*folder.glob("[0-9]*.json"), *folder.glob("sealed-*.json")]):
        meta = json.loads(meta_path.read_text())
        with np.load(meta_path.with_suffix(".npz"), allow_pickle=False) as z:
            arrays = {name: z[f"a{i}"] for i, name in enumerate(meta["arrays"])}
        yield meta_path.stem, {"meta": meta, "arrays": arrays}


def check_audit(
    root: str | Path, partitions: str | Path | None = None
) -> tuple[dict[int, dict], list[Finding]]:
    """Check every client folder under ``root``; returns per-client figures and every finding.

    Args:
        root (str | Path): the audit folder (``client-<id>/`` sub-folders).
        partitions (str | Path | None, optional): a folder of ``part-<id>/`` to compare against,
            instead of the partition each client recorded. (default: :obj:`None`)

    Returns:
        ``(figures, findings)``: ``{client: {"messages", "sealed_plaintexts", "arrays", "payloads",
        "partition"}}`` and
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
        secrets = SecretFinder(load_partition(where))
        n_msgs = n_arrays = n_payloads = n_sealed = 0
        for name, msg in _messages(folder):
            n_msgs += 1
            n_sealed += name.startswith("sealed-")
            values = {k: v for k, v in msg["meta"]["values"].items() if v != "<bytes>"}
            fields = [*msg["arrays"].items(), *values.items()]
            for field, value in fields:
                n_arrays += 1
                leaves = [value] if isinstance(value, np.ndarray) else flatten_values(value)
                for what in (w for leaf in leaves for w in secrets.scan(leaf)):
                    findings.append(Finding(cid, name, field, what))
            for field, arr in msg["arrays"].items():
                if field.partition(_SEP)[0] == "payloads":
                    n_payloads += 1
                    blob = arr.tobytes()
                    if info["encrypted"] and (len(blob) < ENVELOPE_BYTES or not blob.startswith(MAGIC)):
                        findings.append(Finding(cid, name, field, "boundary payload relayed in plaintext"))
        figures[cid] = {
            "messages": n_msgs,
            "sealed_plaintexts": n_sealed,
            "arrays": n_arrays,
            "payloads": n_payloads,
            "partition": str(where),
        }
    return figures, findings
