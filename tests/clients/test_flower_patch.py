"""The SuperNode sleep patch holds for the pinned Flower, and fails loudly for any other code."""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest
from flwr.supernode import start_client_internal as loop

from clients import flower_patch
from clients.flower_patch import EXPECTED_SLEEPS, FlowerPatchError, check_upstream, sleep_calls


def test_the_pinned_supernode_loop_sleeps_where_the_patch_expects():
    # If this fails, Flower's SuperNode loop changed: re-read flwr/supernode/start_client_internal.py
    # and update clients/flower_patch.py (and its docstring's line numbers) to match.
    check_upstream(loop)
    assert tuple(sleep_calls(Path(loop.__file__).read_text())) == EXPECTED_SLEEPS


def _module_with(source: str) -> types.ModuleType:
    module = types.ModuleType("fake_start_client_internal")
    module.time = time  # type: ignore[attr-defined]
    module.__file__ = "<fake>"
    return module


@pytest.mark.parametrize(
    "source",
    [
        "time.sleep(3)\ntime.sleep(0.5)\n",  # one sleep gone
        "time.sleep(2)\ntime.sleep(0.5)\ntime.sleep(0.5)\n",  # a duration changed
        "time.sleep(3)\ntime.sleep(0.5)\ntime.sleep(0.5)\ntime.sleep(0.5)\n",  # a new sleep
        "sleep(3)\ntime.sleep(0.5)\ntime.sleep(0.5)\n",  # imported by name: the proxy would miss it
    ],
)
def test_changed_upstream_code_is_refused(monkeypatch, source):
    monkeypatch.setattr(flower_patch.inspect, "getsource", lambda m: source)
    with pytest.raises(FlowerPatchError, match="expected the sleeps"):
        check_upstream(_module_with(source))


def test_a_module_without_the_time_module_is_refused(monkeypatch):
    source = _SLEEPS
    monkeypatch.setattr(flower_patch.inspect, "getsource", lambda m: source)
    module = _module_with(source)
    module.time = object()  # type: ignore[attr-defined]
    with pytest.raises(FlowerPatchError, match="no longer imports the time module"):
        check_upstream(module)


def test_the_patch_shortens_the_known_sleeps_only(monkeypatch):
    monkeypatch.setattr(loop, "time", loop.time)  # undone after the test
    slept: list[float] = []
    monkeypatch.setattr(flower_patch.time, "sleep", slept.append)
    flower_patch.shorten_supernode_sleeps()
    flower_patch.shorten_supernode_sleeps()  # idempotent
    loop.time.sleep(3)
    loop.time.sleep(0.5)
    loop.time.sleep(0.2)
    assert slept == [0.05, 0.01, 0.2]
    assert loop.time.monotonic is time.monotonic  # everything else is the time module's


_SLEEPS = "time.sleep(3)\ntime.sleep(0.5)\ntime.sleep(0.5)\n"


@pytest.mark.parametrize(
    "launch",
    [
        "",  # the SuperNode no longer starts a SuperExec this way
        'command = ["flower-superexec"]\nsubprocess.Popen(command, env=env)\n',  # a changed call
        'command = ["flower-superexec"]\nsubprocess.Popen(command)\nsubprocess.Popen(command)\n',
    ],
)
def test_a_changed_superexec_launch_is_refused(monkeypatch, launch):
    source = _SLEEPS + launch
    monkeypatch.setattr(flower_patch.inspect, "getsource", lambda m: source)
    with pytest.raises(FlowerPatchError, match="expected the SuperExec launch"):
        check_upstream(_module_with(source))


def test_the_superexec_starts_warm_with_the_same_flags(monkeypatch):
    started: list[list[str]] = []
    monkeypatch.setattr(flower_patch.subprocess, "Popen", lambda args, *a, **k: started.append(args))
    proxy = flower_patch._WarmSuperExec()
    proxy.Popen(["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:9"])
    proxy.Popen(["flwr-clientapp", "--token", "t"])  # anything else is left alone
    assert started == [
        [*flower_patch.WARM_SUPEREXEC, "--insecure", "--runtime-api-address", "127.0.0.1:9"],
        ["flwr-clientapp", "--token", "t"],
    ]
    assert flower_patch.WARM_SUPEREXEC[1:] == ["-m", "clients.warm_superexec"]


def test_object_pulls_retry_sooner_and_changed_defaults_are_refused(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils as u

    for fn in (u.pull_objects, u.pull_and_inflate_object_from_tree):
        monkeypatch.setattr(fn, "__kwdefaults__", dict(fn.__kwdefaults__))  # restored afterwards
        fn.__kwdefaults__.update(flower_patch.EXPECTED_PULL_RETRIES)  # the pinned Flower's values
    flower_patch.shorten_object_pulls()
    flower_patch.shorten_object_pulls()  # idempotent
    shorter = flower_patch.SHORTER_PULL_RETRIES
    for fn in (u.pull_objects, u.pull_and_inflate_object_from_tree):
        assert {k: fn.__kwdefaults__[k] for k in shorter} == shorter
    u.pull_objects.__kwdefaults__["initial_backoff"] = 2  # another Flower's default
    before = dict(u.pull_and_inflate_object_from_tree.__kwdefaults__)
    with pytest.raises(FlowerPatchError, match="pull_objects: expected the retry defaults"):
        flower_patch.shorten_object_pulls()
    assert u.pull_and_inflate_object_from_tree.__kwdefaults__ == before  # nothing half-patched
