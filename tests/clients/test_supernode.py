"""``retexo-fl supernode`` refuses to start a party that the server could read, and how a party
makes its keys so that only public keys travel."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from clients.supernode import check_pinned_keys, main, node_config_of
from retexo_fl.cli import main as cli
from retexo_fl.secure.keys import fingerprint, load_pins, load_private_key, public_bytes


def _own_keys(tmp_path, parties: int = 2):
    """Each party makes its own key in its own folder; one of them collects the pins."""
    for c in range(parties):
        assert cli(["keys", "--client", str(c), "--out", str(tmp_path / f"party-{c}")]) == 0
    pubs = [str(tmp_path / f"party-{c}" / f"client-{c}.pub") for c in range(parties)]
    assert cli(["keys", "--pins", *pubs, "--out", str(tmp_path / "pins.json")]) == 0
    return tmp_path / "party-0" / "client-0.key", tmp_path / "pins.json"


def test_each_party_makes_its_own_key_and_only_public_keys_travel(tmp_path, capsys):
    key, pins = _own_keys(tmp_path)
    out = capsys.readouterr().out
    mine = public_bytes(load_private_key(key))
    assert load_pins(pins)[0] == mine and len(load_pins(pins)) == 2
    assert f"fingerprint {fingerprint(mine)}" in out  # what parties read to each other
    assert json.loads((tmp_path / "party-0" / "client-0.pub").read_text()) == {
        "client": 0,
        "public": mine.hex(),
    }
    # a party's key is never overwritten, and a pins file never holds two keys for one party
    assert cli(["keys", "--client", "0", "--out", str(tmp_path / "party-0")]) == 2
    assert load_private_key(key) is not None and public_bytes(load_private_key(key)) == mine
    pub = str(tmp_path / "party-0" / "client-0.pub")
    assert cli(["keys", "--pins", pub, pub, "--out", str(tmp_path / "twice.json")]) == 2
    assert "a second public key for client 0" in capsys.readouterr().err


def test_a_supernode_without_pins_is_refused_unless_the_party_opts_out_loudly(tmp_path, capsys):
    argv = ["--insecure", "--superlink", "127.0.0.1:1", "--node-config", f"partition-dir='{tmp_path}'"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sets no identity-key and no pinned-keys" in err and "--insecure-no-pinned-keys" in err
    warning = check_pinned_keys(node_config_of(argv), insecure=True)
    assert warning.startswith("WARNING: --insecure-no-pinned-keys") and "can open every" in warning


def test_pins_that_do_not_load_stop_the_node_naming_the_file(tmp_path, capsys):
    key, pins = _own_keys(tmp_path)
    pins.write_text("{not json")
    config = f"identity-key='{key}' pinned-keys='{pins}'"
    assert main(["--insecure", "--node-config", config]) == 2
    assert f"{pins}: pinned keys file unreadable" in capsys.readouterr().err
    assert check_pinned_keys(node_config_of(["--node-config", f"identity-key='{key}'"]), insecure=True)


def test_process_isolation_and_a_bad_trusted_entities_file_are_refused(tmp_path, capsys):
    key, pins = _own_keys(tmp_path)
    config = ["--node-config", f"identity-key='{key}' pinned-keys='{pins}'"]
    assert main(["--insecure", "--isolation", "process", *config]) == 2
    assert "--isolation process" in capsys.readouterr().err
    bad = tmp_path / "trusted.yaml"
    bad.write_text("signer: not a key\n")
    assert main(["--insecure", "--trusted-entities", str(bad), *config]) == 2
    assert "trusted.yaml: 'signer' is not an OpenSSH public key" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["--node-config", "--node-config="])
def test_the_node_config_is_read_as_flower_reads_it(form):
    value = "partition-dir='/p' min-dp-noise=0.5"
    argv = [form + value] if form.endswith("=") else [form, value]
    assert node_config_of(argv) == {"partition-dir": "/p", "min-dp-noise": 0.5}


def test_a_node_given_another_partys_identity_key_is_refused_at_its_start(tmp_path, sbm):
    from clients.supernode import SupernodeRefused
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    key, pins = _own_keys(tmp_path)  # client-0's key
    parts = [
        save_partition(p, tmp_path / f"part-{p.partition_id}") for p in partition_graph(sbm, 2, "random")
    ]

    def config(part, key_file) -> dict:
        return node_config_of(
            ["--node-config", f"partition-dir='{part}' identity-key='{key_file}' pinned-keys='{pins}'"]
        )

    assert check_pinned_keys(config(parts[0], key), insecure=False) == ""
    with pytest.raises(
        SupernodeRefused, match=r"client-0.key is pinned for client 0, and partition .*part-1 is client 1's"
    ):
        check_pinned_keys(config(parts[1], key), insecure=False)
    assert cli(["keys", "--client", "5", "--out", str(tmp_path / "stranger")]) == 0
    with pytest.raises(SupernodeRefused, match=r"client-5\.key: its public key is not in the pins"):
        check_pinned_keys(config(parts[0], tmp_path / "stranger" / "client-5.key"), insecure=False)


def test_a_corrupt_partition_stops_the_node_at_its_start_naming_the_file(tmp_path, sbm, capsys):
    """A truncated array or a hand-edited count is found when the node starts, in the party's own
    log, not at the coordinator in every run's first message."""
    from clients.supernode import check_partition
    from retexo_fl.data.partition import save_partition
    from retexo_fl.data.partitioners import partition_graph

    folder = save_partition(partition_graph(sbm, 2, "random")[0], tmp_path / "part-0")
    check_partition(node_config_of(["--node-config", f"partition-dir='{folder}'"]))  # intact
    (folder / "x.npy").write_bytes((folder / "x.npy").read_bytes()[:-64])
    argv = ["--insecure", "--insecure-no-pinned-keys", "--node-config", f"partition-dir='{folder}'"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "partition-dir:" in err and "x.npy" in err
    missing = ["--insecure", "--insecure-no-pinned-keys", "--node-config", f"partition-dir='{tmp_path}/gone'"]
    assert main(missing) == 2
    assert "gone" in capsys.readouterr().err


def test_a_node_whose_link_ends_exits_and_admits_the_code_it_started_with(monkeypatch):
    """Flower's loop returns when its stream to the SuperLink is cancelled (a SuperLink restart)
    and does not reconnect; the node must then exit, not stay up offline, so that a service
    manager restarts it. The installed app's digest is taken at the start, for every ClientApp
    launch to compare a run's app with: the worker answers with the code it loaded then."""
    import flwr.supercore.exit as flower_exit
    import flwr.supernode.cli as flower_cli

    import clients.supernode as supernode
    from clients.approval import INSTALLED_DIGEST_ENV, app_digest, installed_files

    class Idle:
        def __init__(self, folder):
            pass

        start = stop = lambda self: None

    for name in ("shorten_supernode_sleeps", "shorten_object_pulls", "use_warm_superexec"):
        monkeypatch.setattr(supernode, name, lambda: None)
    monkeypatch.setattr(supernode, "WorkerSupervisor", Idle)
    from flwr.supercore.exit import exit_handler

    from clients.approval import TRUSTED_ENTITIES_ENV
    from clients.flower_patch import SUPEREXEC_POLL_ENV

    # What main() changes in the process, restored after the test.
    monkeypatch.setenv(INSTALLED_DIGEST_ENV, "")
    monkeypatch.setenv(TRUSTED_ENTITIES_ENV, "")
    monkeypatch.setenv(SUPEREXEC_POLL_ENV[0], "")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(exit_handler, "registered_exit_handlers", [])
    seen = {}

    def flower_loop_returns():
        seen.update(digest=os.environ[INSTALLED_DIGEST_ENV])

    monkeypatch.setattr(flower_cli, "flower_supernode", flower_loop_returns)

    def exit_(code, message=None, **_):
        seen.update(code=code, message=message)
        raise SystemExit(1)

    monkeypatch.setattr(flower_exit, "flwr_exit", exit_)
    with pytest.raises(SystemExit):
        main(["--insecure", "--insecure-no-pinned-keys"])
    assert seen["code"] == flower_exit.ExitCode.SUPERNODE_CONNECTION_ERROR
    assert "restart" in seen["message"]
    assert seen["digest"] == app_digest(installed_files())


def test_a_worker_is_not_restarted_with_code_installed_since_the_node_started(tmp_path, monkeypatch, capsys):
    """Runs are admitted against the digest taken at the node's start; a worker that dies after
    the installed files changed would import the new code, so it is not started again."""
    from clients.approval import INSTALLED_DIGEST_ENV, app_digest, installed_files
    from clients.supernode import WorkerSupervisor

    monkeypatch.setenv(INSTALLED_DIGEST_ENV, app_digest(installed_files()))
    same = WorkerSupervisor(tmp_path, [sys.executable, "-c", "pass"]).start()
    while len(same.starts) < 3:  # unchanged: each exit starts a new worker
        time.sleep(0.05)
    same.stop()
    monkeypatch.setenv(INSTALLED_DIGEST_ENV, "0" * 64)  # the files changed since the start
    changed = WorkerSupervisor(tmp_path, [sys.executable, "-c", "pass"]).start()
    changed._thread.join(timeout=30)
    assert not changed._thread.is_alive() and len(changed.starts) == 2  # the first worker only
    assert "the installed app changed since this node started" in capsys.readouterr().err
