"""A party runs only code it approved: its installed app, or a release signed by an entity it trusts.

The FABs here are built by Flower's own builder from a copy of this project, the way ``flwr run .``
builds the one a coordinator submits; the launcher is the one ``retexo-fl supernode`` uses, with
Flower's ClientApp runtime module patched as in a launched ClientApp process.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.cli.build import build_fab_from_disk
from flwr.supernode.runtime import run_clientapp as runtime

from clients import approval
from clients.approval import (
    SIGNATURES_FILE,
    AppNotApproved,
    app_digest,
    approve,
    fab_files,
    installed_digest,
    load_trusted_entities,
    sign_digest,
    tree_files,
)
from clients.flower_patch import FlowerPatchError
from clients.warm_superexec import approve_apps

ROOT = Path(__file__).resolve().parents[2]
#: What a coordinator's replaced ClientApp does at import: leave a mark.
EVIL = "import pathlib, os\npathlib.Path(os.environ['MARKER']).write_text('ran')\n"


def _project(tmp: Path, evil: bool = False) -> Path:
    """A copy of this project's app (what `flwr run .` packs), its ClientApp replaced if ``evil``."""
    out = tmp / ("evil-app" if evil else "app")
    for pkg in approval.APP_PACKAGES:
        shutil.copytree(ROOT / pkg, out / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", SIGNATURES_FILE):
        shutil.copy(ROOT / name, out / name)
    if evil:
        app = out / "clients" / "app.py"
        app.write_text(app.read_text() + EVIL)
    return out


def _signer(tmp: Path, key_id: str = "consortium") -> tuple[ed25519.Ed25519PrivateKey, Path]:
    """A signing key and a trusted-entities file (Flower's YAML format) that trusts it."""
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path = tmp / f"trusted-{key_id}.yaml"
    path.write_text(f"{key_id}: {public.decode()}\n")
    return key, path


def _sign(project: Path, key: ed25519.Ed25519PrivateKey, key_id: str = "consortium") -> None:
    digest = app_digest(tree_files(project))
    (project / SIGNATURES_FILE).write_text(json.dumps([sign_digest(digest, key, key_id)]))


def test_the_submitted_copy_of_the_installed_app_is_answered_by_the_installed_app(tmp_path):
    fab = build_fab_from_disk(_project(tmp_path))
    got = approve(fab)
    assert got.runs_installed and got.fab_digest == got.installed_digest == installed_digest()
    # the release digest a party compares out of band is the installed app's
    assert app_digest(tree_files(ROOT)) == installed_digest()


def test_the_digest_a_node_took_at_its_start_is_the_one_runs_are_admitted_against(tmp_path, monkeypatch):
    """A node's worker answers with the code it loaded at the node's start: a launch compares a
    run's app with the digest taken then (``INSTALLED_DIGEST_ENV``), not with the files now, so a
    FAB of code installed since the start is refused, and one of the code loaded then admitted."""
    fab = build_fab_from_disk(_project(tmp_path))
    now = app_digest(fab_files(fab))
    monkeypatch.setattr(approval, "_INSTALLED", None)  # a freshly launched process
    monkeypatch.setenv(approval.INSTALLED_DIGEST_ENV, "0" * 64)  # the files changed since the start
    with pytest.raises(AppNotApproved, match="0" * 64):
        approve(fab)
    monkeypatch.setattr(approval, "_INSTALLED", None)
    monkeypatch.setenv(approval.INSTALLED_DIGEST_ENV, now)
    assert approve(fab).runs_installed


def test_a_replaced_clientapp_is_refused_naming_both_digests_before_any_of_it_runs(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("MARKER", str(marker))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    evil = build_fab_from_disk(_project(tmp_path, evil=True))
    digest = app_digest(fab_files(evil))
    # the launcher's path: Flower's runtime module, as a launched ClientApp process patches it
    monkeypatch.setattr(runtime, "install_from_fab", runtime.install_from_fab)
    monkeypatch.setattr(runtime, "get_load_client_app_fn", runtime.get_load_client_app_fn)
    approve_apps(runtime, None)
    with pytest.raises(AppNotApproved) as err:
        runtime.install_from_fab(evil, skip_prompt=True)
    assert digest in str(err.value) and installed_digest() in str(err.value)
    assert "trusts no signer" in str(err.value)
    assert not marker.exists() and not (tmp_path / "flwr-home").exists()  # nothing written, nothing run


def test_an_extra_module_or_a_path_outside_the_fab_is_another_app(tmp_path):
    project = _project(tmp_path)
    (project / "server" / "extra.py").write_text("x = 1\n")
    with pytest.raises(AppNotApproved, match="refusing the run's app"):
        approve(build_fab_from_disk(project))
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../clients/app.py", "x = 1\n")
    with pytest.raises(AppNotApproved, match="outside it"):
        approve(buf.getvalue())
    with pytest.raises(AppNotApproved, match="not a readable archive"):
        approve(b"not a zip")


def test_signatures_by_untrusted_keys_or_over_other_code_are_refused(tmp_path):
    key, trusted = _signer(tmp_path)
    other, _ = _signer(tmp_path, "stranger")
    evil = _project(tmp_path, evil=True)
    _sign(evil, other, "consortium")  # the trusted id, another key
    with pytest.raises(AppNotApproved, match="no entity in the trusted-entities file signed it"):
        approve(build_fab_from_disk(evil), trusted)
    _sign(evil, key)
    (evil / "clients" / "app.py").write_text((evil / "clients" / "app.py").read_text() + "\n# later\n")
    with pytest.raises(AppNotApproved, match="no entity"):  # signed, then changed
        approve(build_fab_from_disk(evil), trusted)
    (evil / SIGNATURES_FILE).write_text('[{"public_key_id": "consortium", "signed_at": "x", "signature": 5}]')
    with pytest.raises(AppNotApproved, match="no entity"):  # malformed records are skipped, not trusted
        approve(build_fab_from_disk(evil), trusted)


def _repacked(fab: bytes, add: dict[str, bytes]) -> bytes:
    """``fab`` with the files of ``add`` added or replaced: a coordinator's edit of a release."""
    files = {**fab_files(fab), **add}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return buf.getvalue()


def test_a_signed_release_with_a_test_module_added_is_another_app(tmp_path):
    """Every ``.py`` file counts, tests too: a module named ``test_*.py`` added to a signed
    release changes its digest, so the signature no longer admits it."""
    key, trusted = _signer(tmp_path)
    release = _project(tmp_path, evil=True)
    _sign(release, key)
    fab = build_fab_from_disk(release)
    assert approve(fab, trusted).signer == "consortium"
    for name in ("clients/test_leak.py", "clients/leak_test.py"):
        with pytest.raises(AppNotApproved, match="no entity in the trusted-entities file signed it"):
            approve(_repacked(fab, {name: EVIL.encode()}), trusted)


def test_a_signed_release_that_names_another_clientapp_is_refused(tmp_path):
    """Flower loads the ClientApp a FAB's own ``pyproject.toml`` names, which the digest does not
    cover: a release must name ``clients.app:app``."""
    key, trusted = _signer(tmp_path)
    release = _project(tmp_path, evil=True)
    _sign(release, key)
    fab = build_fab_from_disk(release)
    pyproject = fab_files(fab)["pyproject.toml"].decode()
    assert 'clientapp = "clients.app:app"' in pyproject
    other = pyproject.replace('clientapp = "clients.app:app"', 'clientapp = "server.app:app"')
    named = r"names the ClientApp 'server\.app:app'; a release runs 'clients\.app:app'"
    with pytest.raises(AppNotApproved, match=named):
        approve(_repacked(fab, {"pyproject.toml": other.encode()}), trusted)
    with pytest.raises(AppNotApproved, match=r"its pyproject\.toml names no ClientApp"):
        approve(_repacked(fab, {"pyproject.toml": b"[project]\nname = 'x'\n"}), trusted)


LOADABLE = ["clients/__pycache__/app.cpython-311.pyc", "clients/app.cpython-311-x86_64-linux-gnu.so", "x.pth"]


@pytest.mark.parametrize("path", LOADABLE)
def test_a_signed_release_holding_a_file_python_could_load_beside_its_source_is_refused(tmp_path, path):
    key, trusted = _signer(tmp_path)
    release = _project(tmp_path, evil=True)
    _sign(release, key)
    fab = _repacked(build_fab_from_disk(release), {path: b"\0" * 16})
    with pytest.raises(
        AppNotApproved, match=re.escape(f"its FAB holds {path!r}, which the signature does not cover")
    ):
        approve(fab, trusted)


def test_a_malformed_trusted_entities_file_names_itself(tmp_path):
    bad = tmp_path / "trusted.yaml"
    bad.write_text("consortium: ssh-rsa AAAA\n")
    with pytest.raises(AppNotApproved, match=r"trusted.yaml: 'consortium' is not an OpenSSH public key"):
        load_trusted_entities(bad)
    bad.write_text("- a list\n")
    with pytest.raises(AppNotApproved, match=r"trusted\.yaml: trusted entities must be a YAML mapping"):
        load_trusted_entities(bad)


def test_the_launcher_refuses_a_flower_runtime_it_was_not_written_for(monkeypatch):
    import clients.warm_superexec as launcher

    monkeypatch.setattr(launcher.inspect, "getsource", lambda m: "install_from_fab(fab.content)\n")
    with pytest.raises(FlowerPatchError, match="expected the calls"):
        approve_apps(runtime, None)


SIGNED_RUN = textwrap.dedent(
    """
    import sys
    from flwr.supernode.runtime import run_clientapp as runtime
    from clients.warm_superexec import approve_apps

    fab, trusted = open(sys.argv[1], "rb").read(), sys.argv[2]
    approve_apps(runtime, trusted)
    runtime.install_from_fab(fab, skip_prompt=True)
    from flwr.cli.config_utils import get_fab_metadata
    fab_id, version = get_fab_metadata(fab)
    import hashlib
    app = runtime.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
        fab_id, version, hashlib.sha256(fab).hexdigest()
    )
    print(type(app).__name__, sys.modules["clients.app"].__file__)
    """
)


def test_a_release_signed_by_a_trusted_entity_runs_its_own_code(tmp_path):
    """In a fresh process (it loads another ``clients`` package): Flower installs the signed FAB
    and loads its ClientApp, whose first line runs."""
    marker = tmp_path / "marker"
    key, trusted = _signer(tmp_path)
    evil = _project(tmp_path, evil=True)
    _sign(evil, key)
    fab = tmp_path / "signed.fab"
    fab.write_bytes(build_fab_from_disk(evil))
    env = {**os.environ, "MARKER": str(marker), "FLWR_HOME": str(tmp_path / "flwr-home")}
    done = subprocess.run(
        [sys.executable, "-c", SIGNED_RUN, str(fab), str(trusted)],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "running the app signed by 'consortium'" in done.stderr
    kind, path = done.stdout.splitlines()[-1].split()
    assert kind.endswith("ClientApp") and str(tmp_path / "flwr-home") in path  # the FAB's copy, not ours
    assert marker.read_text() == "ran"


def test_release_sign_writes_a_signature_a_party_accepts(tmp_path, capsys):
    key, trusted = _signer(tmp_path)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    (tmp_path / "signer").write_bytes(pem)
    project = _project(tmp_path, evil=True)
    assert (
        approval.main(["sign", str(project), "--key", str(tmp_path / "signer"), "--key-id", "consortium"])
        == 0
    )
    assert approval.main(["digest", str(project)]) == 0
    digest = capsys.readouterr().out.split()[-1]
    got = approve(build_fab_from_disk(project), trusted)
    assert got.signer == "consortium" and got.fab_digest == digest != installed_digest()


def test_release_refuses_a_folder_that_is_missing_or_holds_no_code(tmp_path, capsys):
    # Each printed (or signed) the digest of nothing, e3b0c442..., as real-looking as any other.
    key, _ = _signer(tmp_path)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    (tmp_path / "signer").write_bytes(pem)
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("")
    sign = ["--key", str(tmp_path / "signer"), "--key-id", "x"]
    (tmp_path / "partial" / "retexo_fl").mkdir(parents=True)  # one of the app's three packages
    (tmp_path / "partial" / "retexo_fl" / "x.py").write_text("x = 1\n")
    cases = (
        ("nowhere", "does not exist"),
        ("empty", "holds no code file"),
        ("afile", "not a folder"),
        ("partial", "the digest covers in clients/, server/"),
    )
    for folder, why in cases:
        for argv in (["digest", str(tmp_path / folder)], ["sign", str(tmp_path / folder), *sign]):
            assert approval.main(argv) == 2
            assert why in capsys.readouterr().err
    assert not (tmp_path / "empty" / "release-signatures.json").exists()
