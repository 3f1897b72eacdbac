"""Which code answers a party's messages: the app it installed, or a release it trusts the signer of.

In deployment the coordinator submits the run's app (a FAB) and Flower's ClientApp process
installs it and imports its ``clients.app``: left as it is, whoever runs the SuperLink decides
the code that reads the party's graph. ``retexo-fl supernode`` launches each ClientApp through
:func:`approve` and :func:`load_app` instead (:mod:`clients.warm_superexec`):

- a FAB whose **app code** (every ``.py`` file it holds) is the installed app's, file for file,
  is answered by the *installed* app; nothing of the FAB is written to disk or imported;
- a FAB whose app code differs runs only if it carries a valid signature (``release
  signature`` below) by an entity in the party's trusted-entities file (``retexo-fl supernode
  --trusted-entities FILE``); then Flower installs and loads it as it always does;
- any other FAB is refused before anything in it runs, with :class:`AppNotApproved` naming both
  digests; the server gets the refusal as the message's error reply.

The **app digest** is SHA-256 over the sorted lines ``<path>\\0<sha256 of the file>`` of every
``.py`` file under the app's packages (:data:`APP_PACKAGES`) and, in a FAB, anywhere else, test
files included: a FAB with one extra module, whatever its name, is another app. (Flower's FAB
builder leaves test files out, so a FAB built from a release holds none.)

A signed release that is not the installed app is held to more than its digest before Flower
loads it (:func:`check_release`): its ``pyproject.toml`` must name :data:`CLIENT_APP` as its
ClientApp (Flower loads whatever the FAB's own ``pyproject.toml`` names, which the digest does
not cover), and it may hold no file Python could import or run that the digest does not cover
(compiled modules, extension libraries, path files): only ``.py`` files and the data files
Flower's builder packs (:data:`RELEASE_DATA_SUFFIXES`).

A **release signature** is Flower's own (the message of
:func:`flwr.supercore.primitives.asymmetric_ed25519.create_message_to_sign`: the signing time,
8 bytes big-endian, then the digest; Ed25519, base64url) over the *app digest* rather than over
the FAB's bytes, so that a coordinator may rebuild the FAB from the signed tree. The trusted
entities file is Flower's ``--trusted-entities`` format (YAML: key id -> ``ssh-ed25519 ...``
public key). Signatures travel in the FAB as :data:`SIGNATURES_FILE`, which is not code and not
part of the digest::

    retexo-fl release digest [PROJECT]                      # the app digest of a source tree
    retexo-fl release sign --key signer_ed25519 --key-id consortium-2026 [PROJECT]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.util
import io
import json
import os
import sys
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

#: The packages a ClientApp of this project imports: the installed app is their ``.py`` files.
APP_PACKAGES = ("clients", "retexo_fl", "server")
#: The file of a FAB (and of a signed source tree) that holds its release signatures.
SIGNATURES_FILE = "release-signatures.json"
#: Where ``retexo-fl supernode`` tells its ClientApp launches the party's trusted-entities file.
TRUSTED_ENTITIES_ENV = "RETEXO_FL_TRUSTED_ENTITIES"
#: Where ``retexo-fl supernode`` tells its ClientApp launches the installed app's digest, taken
#: once when the node starts: the code its worker and warm SuperExec loaded then is what answers.
INSTALLED_DIGEST_ENV = "RETEXO_FL_INSTALLED_DIGEST"
#: The ClientApp a signed release must name in its ``pyproject.toml`` (the one the digest covers).
CLIENT_APP = "clients.app:app"
#: Besides ``.py`` files, what a signed release may hold: the data files Flower's FAB builder
#: packs (its ``FAB_INCLUDE_PATTERNS``), its content manifest and ``LICENSE``. None of them is
#: imported; a ``.pyc``, ``.so`` or ``.pth`` file would be, ahead of or beside the signed source.
RELEASE_DATA_SUFFIXES = (".toml", ".md", ".yaml", ".yml", ".json", ".jsonl")
RELEASE_DATA_FILES = (".info/CONTENT", "LICENSE")
#: A FAB is at most 10 MiB (Flower's ``FAB_MAX_SIZE``); what it unpacks to is bounded too, so a
#: crafted archive cannot exhaust the node's memory before it is refused.
MAX_UNPACKED = 64 << 20


class AppNotApproved(RuntimeError):
    """A run's app that this party did not approve: not its installed app, and not signed by an
    entity it trusts. The message names both digests."""


@dataclass(frozen=True)
class Approval:
    """Why a run's app may run here.

    Args:
        fab_digest (str): the app digest of the run's FAB.
        installed_digest (str): the app digest of the installed app.
        signer (str): the trusted entity whose signature admitted a different app ("" when the
            FAB is the installed app, which then answers instead of the FAB).
    """

    fab_digest: str
    installed_digest: str
    signer: str = ""

    @property
    def runs_installed(self) -> bool:
        """Whether the installed app answers (the FAB's code is never loaded)."""
        return not self.signer


def is_code(path: str) -> bool:
    """Whether ``path`` (POSIX, relative) counts as app code: a ``.py`` file, tests included (a
    FAB's ``test_*.py`` is as importable as any module, and Flower's builder packs none)."""
    return PurePosixPath(path).name.endswith(".py")


def app_digest(files: Mapping[str, bytes]) -> str:
    """The app digest (hex) of ``files`` (relative POSIX path -> content); non-code files are skipped."""
    lines = sorted(
        f"{path}\0{hashlib.sha256(data).hexdigest()}" for path, data in files.items() if is_code(path)
    )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def tree_files(root: Path, packages: tuple[str, ...] = APP_PACKAGES) -> dict[str, bytes]:
    """The code files of ``packages`` under the source tree ``root``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" not in rel.split("/") and is_code(rel):
                out[rel] = path.read_bytes()
    return out


def installed_files() -> dict[str, bytes]:
    """The code files of the installed app (:data:`APP_PACKAGES` as this interpreter imports them)."""
    out: dict[str, bytes] = {}
    for pkg in APP_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise AppNotApproved(f"package {pkg!r} of the installed app is not importable here")
        for location in spec.submodule_search_locations:
            base = Path(location)
            for path in sorted(base.rglob("*.py")):
                rel = f"{pkg}/{path.relative_to(base).as_posix()}"
                if "__pycache__" not in rel.split("/") and is_code(rel):
                    out[rel] = path.read_bytes()
    return out


def fab_files(fab: bytes) -> dict[str, bytes]:
    """Every file of a FAB (a zip archive), read without writing or running any of it.

    Raises:
        AppNotApproved: not a zip archive, a path that leaves the archive, or more than
            :data:`MAX_UNPACKED` bytes unpacked.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(fab))
        members = [m for m in archive.infolist() if not m.is_dir()]
        if sum(m.file_size for m in members) > MAX_UNPACKED:
            raise AppNotApproved(f"the run's FAB unpacks to more than {MAX_UNPACKED} bytes")
        out = {}
        for member in members:
            path = PurePosixPath(member.filename)
            if path.is_absolute() or ".." in path.parts:
                raise AppNotApproved(f"the run's FAB holds a path outside it: {member.filename!r}")
            out[path.as_posix()] = archive.read(member)
        return out
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise AppNotApproved(f"the run's FAB is not a readable archive ({exc})") from None


# -- release signatures -------------------------------------------------------------------------
def load_trusted_entities(path: str | Path) -> dict[str, Any]:
    """A trusted-entities file (Flower's format: YAML, key id -> OpenSSH Ed25519 public key).

    Raises:
        AppNotApproved: unreadable, not a mapping, or a key that is not an Ed25519 public key,
            naming the file and the key id.
    """
    import yaml
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise AppNotApproved(f"{p}: trusted entities file unreadable ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise AppNotApproved(
            f"{p}: trusted entities must be a YAML mapping of key id -> ssh-ed25519 public key"
        )
    out = {}
    for key_id, text in data.items():
        try:
            key = load_ssh_public_key(str(text).encode())
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise AppNotApproved(f"{p}: {key_id!r} is not an OpenSSH public key") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise AppNotApproved(f"{p}: {key_id!r} is not an Ed25519 key")
        out[str(key_id)] = key
    return out


def sign_digest(digest: str, private_key: Any, key_id: str, signed_at: int | None = None) -> dict[str, Any]:
    """A release signature record of the app digest ``digest`` by ``private_key`` (Ed25519)."""
    from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign

    when = int(time.time()) if signed_at is None else int(signed_at)
    signature = private_key.sign(create_message_to_sign(bytes.fromhex(digest), when))
    encoded = base64.urlsafe_b64encode(signature).decode().rstrip("=")
    return {"public_key_id": key_id, "signed_at": when, "signature": encoded}


def signer_of(digest: str, records: Any, trusted: Mapping[str, Any]) -> str:
    """The first trusted key id with a valid signature of ``digest`` in ``records`` ("" if none).

    A malformed record is skipped, not trusted: the records come with the FAB, from the
    coordinator.
    """
    from flwr.supercore.primitives.asymmetric_ed25519 import (
        create_message_to_sign,
        decode_base64url,
        verify_signature,
    )

    for record in records if isinstance(records, list) else []:
        if not isinstance(record, dict) or str(record.get("public_key_id")) not in trusted:
            continue
        try:
            message = create_message_to_sign(bytes.fromhex(digest), int(record["signed_at"]))
            signature = decode_base64url(str(record["signature"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        key_id = str(record["public_key_id"])
        if verify_signature(trusted[key_id], message, signature):
            return key_id
    return ""


# -- approval -----------------------------------------------------------------------------------
_INSTALLED: str | None = None


def installed_digest() -> str:
    """The installed app's digest: the one its node took at its start
    (:data:`INSTALLED_DIGEST_ENV`), else read once per process.

    A node's worker and warm SuperExec import the app when the node starts, and answer with
    that code until it restarts: a digest read from the files at each launch would admit a FAB
    of code installed since, which is not the code that answers.
    """
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = os.environ.get(INSTALLED_DIGEST_ENV) or app_digest(installed_files())
    return _INSTALLED


def approve(fab: bytes, trusted_entities: str | Path | None = None) -> Approval:
    """Admit the run's FAB or refuse it, reading it only.

    Args:
        fab (bytes): the run's FAB.
        trusted_entities (str | Path, optional): the party's trusted-entities file; without one,
            only the installed app's code is admitted.

    Raises:
        AppNotApproved: the FAB's app code is not the installed app's and no trusted entity
            signed it; names both digests.
    """
    files = fab_files(fab)
    fab_digest, mine = app_digest(files), installed_digest()
    if fab_digest == mine:
        return Approval(fab_digest, mine)
    trusted = load_trusted_entities(trusted_entities) if trusted_entities else {}
    records: Any = []
    if SIGNATURES_FILE in files:
        try:
            records = json.loads(files[SIGNATURES_FILE])
        except (ValueError, UnicodeDecodeError):
            records = []
    signer = signer_of(fab_digest, records, trusted) if trusted else ""
    if signer:
        check_release(files, signer)
        return Approval(fab_digest, mine, signer)
    why = (
        "and no entity in the trusted-entities file signed it"
        if trusted
        else "and this node trusts no signer (retexo-fl supernode --trusted-entities FILE)"
    )
    raise AppNotApproved(
        f"refusing the run's app: its code has app digest {fab_digest}, this node's installed app "
        f"has {mine}, {why}; nothing of the FAB was run"
    )


def check_release(files: Mapping[str, bytes], signer: str) -> None:
    """Refuse a signed release whose signature does not cover what Flower would run of it.

    Args:
        files (Mapping[str, bytes]): the FAB's files (:func:`fab_files`).
        signer (str): the trusted entity that signed its app digest (named in the error).

    Raises:
        AppNotApproved: the FAB's ``pyproject.toml`` is missing, unreadable or names another
            ClientApp than :data:`CLIENT_APP`, or the FAB holds a file that is neither code nor
            one of the data files a release may hold; names the file or the entry.
    """
    import tomllib

    where = f"refusing the release signed by {signer!r}"
    for path in sorted(files):
        name = PurePosixPath(path).name
        if is_code(path) or path in (SIGNATURES_FILE, *RELEASE_DATA_FILES):
            continue
        if not name.endswith(RELEASE_DATA_SUFFIXES) or "__pycache__" in PurePosixPath(path).parts:
            raise AppNotApproved(
                f"{where}: its FAB holds {path!r}, which the signature does not cover and Python "
                "could load; a release holds .py files and data files only"
            )
    try:
        config = tomllib.loads(files["pyproject.toml"].decode())
        entry = config["tool"]["flwr"]["app"]["components"]["clientapp"]
    except (KeyError, TypeError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AppNotApproved(f"{where}: its pyproject.toml names no ClientApp ({exc!r})") from None
    if entry != CLIENT_APP:
        raise AppNotApproved(
            f"{where}: its pyproject.toml names the ClientApp {str(entry)[:80]!r}; a release runs "
            f"{CLIENT_APP!r}, the module its signature covers"
        )


def load_app(approval: Approval, flower_load: Any, *fab_ref: str) -> Any:
    """The ClientApp that answers: the installed ``clients.app:app``, or, for a signed release,
    the FAB's app as Flower loads it (``flower_load(fab_id, fab_version, fab_hash)``)."""
    if approval.runs_installed:
        return importlib.import_module("clients.app").app
    # Flower puts the installed FAB first on sys.path; forget the installed package so that its
    # `clients.app` is the one imported.
    for name in [m for m in sys.modules if m == "clients" or m.startswith("clients.")]:
        del sys.modules[name]
    return flower_load(*fab_ref)


# -- retexo-fl release --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``retexo-fl release digest|sign``: a source tree's app digest, or sign it as a release."""
    parser = argparse.ArgumentParser(prog="retexo-fl release", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    d = sub.add_parser("digest", help="print the app digest of a source tree (what a party compares)")
    d.add_argument("project", nargs="?", default=".")
    s = sub.add_parser("sign", help=f"sign a source tree's app digest into its {SIGNATURES_FILE}")
    s.add_argument("project", nargs="?", default=".")
    s.add_argument(
        "--key", required=True, help="the signer's OpenSSH Ed25519 private key (ssh-keygen -t ed25519)"
    )
    s.add_argument(
        "--key-id", required=True, help="the signer's id, as parties list it in their trusted entities"
    )
    args = parser.parse_args(argv)
    root = Path(args.project)
    # A mistyped or empty folder would print (or sign) the digest of nothing, which looks as
    # real as any other.
    if not root.is_dir():
        print(
            f"retexo-fl release: error: {root}: {'not a folder' if root.exists() else 'does not exist'}",
            file=sys.stderr,
        )
        return 2
    files = tree_files(root)
    # A tree without one of the app's packages has a digest no installed app can match.
    lacking = [pkg for pkg in APP_PACKAGES if not any(path.startswith(f"{pkg}/") for path in files)]
    if lacking:
        print(
            f"retexo-fl release: error: {root}: holds no code file the digest covers in "
            f"{', '.join(f'{pkg}/' for pkg in lacking)} (the app is {', '.join(APP_PACKAGES)})",
            file=sys.stderr,
        )
        return 2
    digest = app_digest(files)
    if args.action == "digest":
        print(digest)
        return 0
    from flwr.supercore.primitives.asymmetric_ed25519 import load_private_key

    try:
        key = load_private_key(Path(args.key))
    except (OSError, ValueError) as exc:
        print(f"retexo-fl release: error: {args.key}: {exc}", file=sys.stderr)
        return 2
    path = root / SIGNATURES_FILE
    records = json.loads(path.read_text()) if path.is_file() else []
    records = [r for r in records if r.get("public_key_id") != args.key_id]
    records.append(sign_digest(digest, key, args.key_id))
    path.write_text(json.dumps(records, indent=2) + "\n")
    print(f"signed app digest {digest} as {args.key_id!r} into {path}")
    return 0
