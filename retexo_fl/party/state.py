"""What a client keeps between messages: one dataclass, one save path, one load path.

A deployed ClientApp is a new process per message, and Ray may hand a simulated node's next
message to another actor: everything a later message needs, besides the partition itself,
is written to the node-local work folder after a message that changed it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from retexo_fl.records import StateDict
from retexo_fl.secure.keys import private_folder

#: The file a client's state lives in, inside its node-local work folder.
STATE_FILE = "client-state.pt"


@dataclass
class ClientState:
    """A client's node-local state between messages.

    Args:
        stage (int): the lazy stage the client is at (eager: always 0).
        owned (Tensor, optional): the owned rows' stage input (lazy), ``[n, d]``; :obj:`None` at a
            layer-0 stage, whose input is the partition's raw features (never copied here).
        halo (Tensor, optional): the halo rows' stage input (lazy), ``[h, d]``.
        halo_layers (list[Tensor], optional): eager: each conv layer's halo rows, ``[h, hidden]``.
        halo_degree (Tensor, optional): GCN: the halo nodes' global in-degrees, ``[h]``.
        residual (StateDict, optional): error feedback of compressed updates, this stage.
        view (StateDict, optional): the model as the compressed broadcast left it.
        kept (StateDict, optional): a view the server named the stage's best so far (a later
            message names it by digest instead of sending it again).
        earlier_view (StateDict, optional): ``first-stage auto``: the first training of stage 0's
            last view, held while the second trains (it may still be chosen).
        earlier_kept (StateDict, optional): ... and the view it kept.
        channel (dict, optional): the sealed channels (:meth:`PeerChannel.to_state`): the X25519
            private key, which never leaves this folder, the key directory, the run transcript
            and each direction's payload counters.
        halo_round (int): eager: the newest round whose halo rows were accepted.
        sent (list, optional): ``[stage, frames, stats JSON, test]`` of the last boundary rows
            sent, for a resumed server that asks again; ``test`` is ``[correct, count, loss]`` of
            the state they were computed with, when the embed asked for it (else ``None``).
        pseudo_labels (Tensor, optional): self-training labels, ``[n]`` (node-local, like labels).
        pseudo_mask (Tensor, optional): the training mask with them, ``[n]``.
        teacher (Tensor, optional): self-training: the logits of the best-validating stage so far
            on this client's nodes, ``[n, C]``, which the next pass's labels are read from.
        control (StateDict, optional): drift correction: this client's control variate, this stage.
        control_view (StateDict, optional): drift correction: the server's control variate as
            its broadcast left it.
        journal (list, optional): ``[[stage, trial, round], {name: state}, incoming counters]``, what
            the last train round found, so that the same round sent again (a resumed server)
            starts from it; ``{name: state}`` is the name of a file in the same folder when the
            state saved before the round holds it (the journal's fields are read from there).
        delivered (str, optional): the digest of the last deliveries a test or an embed opened
            (the same message sent again is not opened twice).
        boundary_releases (int): boundary row releases this client made in the run (counted
            against its own ``max-boundary-epsilon``).
        secagg (dict, optional): secure aggregation: the survivor set answered per round, and
            the last masked round's reply with this client's own share of its self seed.
        run_config (str, optional): the digest of the run config setup bound
            (:func:`~retexo_fl.protocol.client_config_digest`); every later message's must equal it.
        lanes (dict, optional): ``first-stage auto`` trained in parallel: each variant's round
            state (view, residual, journal, ...) but the one the fields above hold.
        lane (str, optional): ... and the variant whose round state the fields hold.
    """

    stage: int = 0
    owned: Tensor | None = None
    halo: Tensor | None = None
    halo_layers: list[Tensor] | None = None
    halo_degree: Tensor | None = None
    residual: StateDict | None = None
    view: StateDict | None = None
    kept: StateDict | None = None
    earlier_view: StateDict | None = None
    earlier_kept: StateDict | None = None
    channel: dict | None = None
    halo_round: int = 0
    sent: list[Any] | None = None
    pseudo_labels: Tensor | None = None
    pseudo_mask: Tensor | None = None
    teacher: Tensor | None = None
    control: StateDict | None = None
    control_view: StateDict | None = None
    journal: list[Any] | None = None
    delivered: str | None = None
    boundary_releases: int = 0
    secagg: dict | None = None
    run_config: str | None = None
    lanes: dict | None = None
    lane: str | None = None

    def save(self, folder: str | Path, journal_link: str | None = None) -> Path:
        """Write to ``folder``/:data:`STATE_FILE` atomically, readable by this user alone.

        Args:
            folder (str or Path): the node-local work folder.
            journal_link (str, optional): first keep the state file there now under this name
                in ``folder`` (a hard link): it holds what the round journal found, and this
                state's journal names it. Other journal files there are removed once this state
                is written. (default: :obj:`None`)

        Returns:
            Path: the file written.
        """
        path = private_folder(folder) / STATE_FILE
        tmp = path.with_name(STATE_FILE + ".tmp")
        spare = path.with_name(SPARE_FILE)
        fd = _writable(tmp, spare)
        # Field by field, not dataclasses.asdict: that deep-copies every tensor and container
        # first, a sixth of a node-level simulation's client time (its key directory is
        # thousands of entries), for a file written at once.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        channel = values.get("channel")
        if channel and channel.get("directory"):
            # The key directory (every party's public key) is the run's, not the message's: one
            # file named by its digest, written once, and the state names it. Saved in every
            # state, it was nearly all of a node-level client's load and save time (Cora: 2,708
            # keys, 10 of a load's 10.3 ms).
            digest = _save_directory(path.parent, channel["directory"])
            values["channel"] = {**channel, "directory": None, DIRECTORY_DIGEST: digest}
        with os.fdopen(fd, "wb") as f:
            f.writelines(state_parts(values))
            f.truncate()  # a reused file may have been longer
        if journal_link is not None:
            # Linked under a temporary name, then renamed: at every step the folder holds a
            # complete state file and every journal file a saved state names.
            kept = path.with_name(journal_link)
            staged = kept.with_name(kept.name + ".tmp")
            staged.unlink(missing_ok=True)
            try:
                os.link(path, staged)
            except OSError:  # a file system without hard links: a copy holds the same
                shutil.copyfile(path, staged)
            staged.replace(kept)
        else:
            _keep_spare(path, spare)  # the state replaced now, unless a journal names it
        tmp.replace(path)
        named = self.journal[1] if self.journal and isinstance(self.journal[1], str) else None
        if journal_link is not None or named is None:
            for old in path.parent.glob(JOURNAL_GLOB):  # the journals no saved state names
                if old.name != named and not _keep_spare(old, spare, move=True):
                    old.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, folder: str | Path) -> ClientState | None:
        """The state saved in ``folder``, or ``None`` if there is none.

        Raises:
            ValueError: the file exists but is not a client state (naming the file).
        """
        path = Path(folder) / STATE_FILE
        if not path.is_file():
            return None
        try:
            values = read_state_file(path)
            state = cls(**values)
        except Exception as exc:  # a truncated or foreign file: name it instead of a pickle traceback
            raise ValueError(f"{path}: not a client state ({type(exc).__name__}: {exc})") from None
        channel = state.channel
        if channel and channel.get(DIRECTORY_DIGEST):
            directory = _load_directory(Path(folder), str(channel[DIRECTORY_DIGEST]))
            state.channel = {**channel, "directory": directory}
        return state


#: The files a saved state's round journal names (:func:`~retexo_fl.party.persistence.journal_file_name`).
JOURNAL_GLOB = "journal-*.state"
#: A state file no name needs any more, kept to be written over by the next save: at one node
#: per client in Flower simulation a node's state is saved at every message, and a new file
#: written, renamed over the last and the one before deleted cost 0.67 ms a save of 0.56 MB on
#: an ext4 disk (likely the blocks allocated and freed each time), against 0.09 ms for writing
#: over a spare one.
SPARE_FILE = STATE_FILE + ".spare"


def _writable(tmp: Path, spare: Path) -> int:
    """A descriptor of ``tmp`` to write a state into: the spare file renamed to it and written
    over (:data:`SPARE_FILE`), or a new file.

    The file holds the identity key and, after a conv stage's start, this client's own
    embeddings and halo rows: owner-only from birth, in an owner-only folder; a spare is one of
    this client's earlier state files, and is used only while no other name links to it.
    """
    try:
        spare.replace(tmp)
        fd = os.open(tmp, os.O_WRONLY)
    except FileNotFoundError:
        pass
    else:
        info = os.fstat(fd)
        if info.st_nlink == 1 and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return fd
        os.close(fd)
        tmp.unlink(missing_ok=True)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


def _keep_spare(path: Path, spare: Path, move: bool = False) -> bool:
    """Keep the file at ``path`` as the spare (:data:`SPARE_FILE`) when none is kept and no
    other name links to it: renamed (``move``) or linked (the state file, about to be replaced).
    Returns whether it was kept."""
    try:
        if spare.exists() or os.stat(path).st_nlink != 1:
            return False
        if move:
            path.replace(spare)
        else:
            os.link(path, spare)
    except OSError:  # gone, or no hard links here: the next save writes a new file
        return False
    return True


#: The entry of a saved state's channel that names its key directory's file by digest.
DIRECTORY_DIGEST = "directory-digest"
#: Key directories saved (by the identity of the dict saved) and loaded (by digest) in this
#: process: a node-level run's thousands of states share one.
_saved_digests: dict[int, tuple[dict, str, bytes]] = {}
_loaded: dict[str, dict[str, str]] = {}
_DIRECTORIES_KEPT = 4


def _directory_text(directory: dict[str, str]) -> bytes:
    """The directory file's bytes, which its digest is of."""
    return json.dumps(directory, sort_keys=True, separators=(",", ":")).encode()


def _directory_digest(directory: dict[str, str]) -> str:
    return hashlib.sha256(_directory_text(directory)).hexdigest()


def _directory_file(folder: Path, digest: str) -> Path:
    return folder / f"key-directory-{digest[:32]}.json"


def _keep(cache: dict, key: object, value: object) -> None:
    cache[key] = value
    while len(cache) > _DIRECTORIES_KEPT:
        cache.pop(next(iter(cache)))


def _save_directory(folder: Path, directory: dict[str, str]) -> str:
    """Write ``directory`` (client id -> key hex) to its file in ``folder`` unless it is there;
    return its digest."""
    memo = _saved_digests.get(id(directory))
    if memo is not None and memo[0] is directory:
        digest, text = memo[1], memo[2]
    else:
        text = _directory_text(directory)
        digest = hashlib.sha256(text).hexdigest()
        _keep(_saved_digests, id(directory), (directory, digest, text))
        # A state of this process that names the digest loads this very dict back (and the
        # channel the view it was made from), not a parsed copy checked again.
        if digest not in _loaded:
            _keep(_loaded, digest, directory)
    path = _directory_file(folder, digest)
    if not path.is_file():  # each node folder its own copy, written from the text made once
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        tmp.replace(path)
    return digest


def _load_directory(folder: Path, digest: str) -> dict[str, str]:
    """The key directory a saved state names, checked against its digest.

    Raises:
        ValueError: the file is missing, unreadable or not the directory named (naming it).
    """
    cached = _loaded.get(digest)
    if cached is not None:
        return cached
    path = _directory_file(folder, digest)
    try:
        directory = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: the key directory this client's state names ({exc})") from None
    if not isinstance(directory, dict) or _directory_digest(directory) != digest:
        raise ValueError(f"{path}: not the key directory this client's state names (digest differs)")
    _keep(_loaded, digest, directory)
    return directory


# -- the file format ------------------------------------------------------------------------------
#: The first bytes of a state file: a JSON skeleton of the values, then each tensor's and byte
#: string's raw bytes. Neither ``torch.save`` nor pickle: a simulated node's state is written
#: and read at every message, and torch's zip writer and weights-only unpickler were a third of
#: a node-level client's time (Cora, 2,708 one-node clients in Flower simulation); the format
#: also runs no code when read, as ``weights_only`` guaranteed.
STATE_MAGIC = b"RXFLSTATE1\n"
_HEADER = struct.Struct("<Q")
_ALIGN = 64  # each tensor's bytes start at a multiple of this (any dtype's alignment)


def encode_state(values: dict[str, Any]) -> bytes:
    """``values`` (a state's fields) as a state file's bytes (see :func:`state_parts`)."""
    return b"".join(state_parts(values))


def state_parts(values: dict[str, Any]) -> list[bytes | memoryview]:
    """``values`` (a state's fields) as the pieces of a state file, in order: the tensors' bytes
    are views of the tensors, not copies (written out once, by the caller).

    Raises:
        TypeError: a value that is not ``None``, a bool, int, float, str, bytes, tensor, list,
            tuple or dict of those (dict keys: str or int).
    """
    blobs: list[tuple[dict[str, Any], bytes | memoryview]] = []
    # A tensor held twice (the journal's view of a round and the kept view, say) is written once
    # and read back as one tensor, as torch.save did: by identity (the values hold them alive).
    written: dict[int, int] = {}

    def tree(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, Tensor):
            if id(value) in written:
                return {"T": written[id(value)]}
            t = value.detach()
            meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if t.device.type != "cpu":
                meta["device"] = str(t.device)
            flat = t.cpu().contiguous().reshape(-1)
            blobs.append((meta, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""))
            written[id(value)] = len(blobs) - 1
            return {"T": len(blobs) - 1}
        if isinstance(value, bytes | bytearray | memoryview):
            blobs.append(({"bytes": True}, bytes(value)))
            return {"B": len(blobs) - 1}
        if isinstance(value, list):
            return [tree(v) for v in value]
        if isinstance(value, tuple):
            return {"t": [tree(v) for v in value]}
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(f"a client state's dict key {k!r} ({type(k).__name__}): str or int only")
            return {"d": [[k, tree(v)] for k, v in value.items()]}
        raise TypeError(f"a client state cannot hold a {type(value).__name__}")

    skeleton = tree(values)
    entries, body, offset = [], [], 0
    for meta, raw in blobs:
        aligned = -(-offset // _ALIGN) * _ALIGN
        if aligned > offset:
            body.append(bytes(aligned - offset))
        entries.append({**meta, "at": aligned, "n": len(raw)})
        body.append(raw)
        offset = aligned + len(raw)
    header = json.dumps({"values": skeleton, "blobs": entries}, separators=(",", ":")).encode()
    return [STATE_MAGIC, _HEADER.pack(len(header)), header, *body]


def decode_state(data: bytes) -> dict[str, Any]:
    """The values :func:`encode_state` wrote.

    Raises:
        ValueError: ``data`` is not a state file, or is cut short.
    """
    if not data.startswith(STATE_MAGIC):
        raise ValueError("no state file header")
    start = len(STATE_MAGIC) + _HEADER.size
    if len(data) < start:
        raise ValueError("cut short")
    (size,) = _HEADER.unpack_from(data, len(STATE_MAGIC))
    head = json.loads(data[start : start + size])
    body = bytearray(memoryview(data)[start + size :])  # writable: tensors are views of it
    blobs = head["blobs"]

    read: dict[int, Any] = {}

    def blob(i: int) -> Any:
        if i not in read:
            read[i] = _blob(i)
        return read[i]

    def _blob(i: int) -> Any:
        entry = blobs[i]
        at, n = int(entry["at"]), int(entry["n"])
        if at + n > len(body):
            raise ValueError("cut short")
        if entry.get("bytes"):
            return bytes(body[at : at + n])
        dtype = getattr(torch, str(entry["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {entry['dtype']!r}")
        shape = [int(d) for d in entry["shape"]]
        if n == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(body, dtype=torch.uint8, count=n, offset=at).view(dtype).reshape(shape)
        return t.to(entry["device"]) if "device" in entry else t

    def value(node: Any) -> Any:
        if isinstance(node, list):
            return [value(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "T" in node or "B" in node:
            return blob(int(node.get("T", node.get("B"))))
        if "t" in node:
            return tuple(value(v) for v in node["t"])
        return {k: value(v) for k, v in node["d"]}

    out = value(head["values"])
    if not isinstance(out, dict):
        raise ValueError("not a map of fields")
    return out


def read_state_file(path: str | Path) -> dict[str, Any]:
    """The field values a state file at ``path`` holds (one of an earlier version, written with
    ``torch.save``, too).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a state file.
    """
    data = Path(path).read_bytes()
    if data.startswith(b"PK\x03\x04"):  # torch.save's zip: a state of an earlier version
        return torch.load(io.BytesIO(data), weights_only=True)
    return decode_state(data)
