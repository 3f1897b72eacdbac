"""Shorter SuperNode sleeps for the pinned Flower range (``flwr>=1.38,<1.40``): a documented patch.

Flower 1.39's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps fixed times and
offers no setting for them:

- line 276, ``time.sleep(3)``: after every pull that finds no message, which happens once a
  round on every node (the reply of round r goes up before round r+1 exists);
- line 483, ``time.sleep(0.5)``: while it waits for the ClientApp's reply;
- line 519, ``time.sleep(0.5)``: while it waits for a reply's objects in its store.

A message can wait up to 3 s + 2 x 0.5 s on them, and the 3 s one is hit once a round.
:func:`shorten_supernode_sleeps` swaps the module's ``time`` for a proxy whose ``sleep`` maps
each of those durations to tens of milliseconds; every other use of ``time`` in the module is
untouched. The SuperExec's own 1 s task poll *is* a setting
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``), set by :data:`SUPEREXEC_POLL_ENV`.

The same module starts the SuperExec (lines 221-234: ``command = ["flower-superexec"]``, then
``subprocess.Popen(command)``). :func:`use_warm_superexec` swaps the module's ``subprocess`` for a
proxy whose ``Popen`` runs :mod:`clients.warm_superexec` with the same flags instead: Flower's
SuperExec, forking ClientApp processes from a warm one.

Every Flower process pulls a message's objects with ``pull_objects`` (directly, or through
``pull_and_inflate_object_from_tree``; both in ``flwr/supercore/inflatable/inflatable_utils.py``),
which retries an object that is not there yet after 1 s, backing off to 10 s (their keyword
defaults ``initial_backoff=1``, ``backoff_cap=10``). The SuperNode stores a message before its
objects, so the SuperExec launches its ClientApp early, and that ClientApp regularly finds an
object that lands milliseconds later and sleeps the whole second (measured: 1.0 of its 1.8 s).
:func:`shorten_object_pulls` sets 20 ms and 0.5 s, and raises the tries per object so that the
time an object is waited for stays Flower's (``max_time``, 2 h, still bounds it).

:func:`check_upstream` reads the installed module's source and refuses to patch unless those
three sleeps, and nothing else that sleeps, and that launch are where this module expects them:
a Flower release that changes them must fail loudly (``tests/clients/test_flower_patch.py``),
not silently keep a 3 s sleep or shorten one that means something else.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

#: Upstream sleep (seconds) -> ours. 50 ms idle pulls cost a loopback or WAN request each; the
#: two waits inside a round poll local state only.
SHORTER_SLEEPS: dict[float, float] = {3.0: 0.05, 0.5: 0.01}
#: The sleep calls the pinned module must hold, in order of appearance.
EXPECTED_SLEEPS = ("time.sleep(3)", "time.sleep(0.5)", "time.sleep(0.5)")
#: The SuperExec's task poll (Flower's own setting; its default is 1 s) and the value we set:
#: each poll is an HTTP request to the SuperNode, so 20 ms polls from three nodes cost a core.
SUPEREXEC_POLL_ENV = ("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.05")
#: How the pinned module starts the SuperExec (both lines must be there, once each).
EXPECTED_LAUNCH = ('command = ["flower-superexec"]', "subprocess.Popen(command)")
#: What runs instead: Flower's SuperExec with warm ClientApp launches.
WARM_SUPEREXEC = [sys.executable, "-m", "clients.warm_superexec"]


class FlowerPatchError(RuntimeError):
    """The installed Flower's SuperNode loop is not the code this patch was written for."""


class _ShortSleeps:
    """``time`` as the SuperNode module sees it: the same, with the known sleeps shortened."""

    def __init__(self, sleeps: dict[float, float]) -> None:
        self._sleeps = sleeps

    def sleep(self, seconds: float) -> None:
        time.sleep(self._sleeps.get(float(seconds), seconds))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _WarmSuperExec:
    """``subprocess`` as the SuperNode module sees it: ``flower-superexec`` runs warm."""

    def Popen(self, args: list[str], *rest: Any, **kwargs: Any) -> subprocess.Popen:
        if args and args[0] == "flower-superexec":
            args = [*WARM_SUPEREXEC, *args[1:]]
        return subprocess.Popen(args, *rest, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


#: ``pull_objects``' retry settings in the pinned Flower, and ours.
EXPECTED_PULL_RETRIES = {"initial_backoff": 1, "backoff_cap": 10, "max_tries_per_object": 500}
SHORTER_PULL_RETRIES = {"initial_backoff": 0.02, "backoff_cap": 0.5, "max_tries_per_object": 10_000}


def shorten_object_pulls() -> None:
    """Retry a missing object after 20 ms instead of 1 s in this process (idempotent).

    Raises:
        FlowerPatchError: ``pull_objects`` has other keyword defaults than the pinned Flower's.
    """
    from flwr.supercore.inflatable import inflatable_utils

    functions = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
    for fn in functions:  # check both before changing either
        current = {k: (fn.__kwdefaults__ or {}).get(k) for k in EXPECTED_PULL_RETRIES}
        if current not in (EXPECTED_PULL_RETRIES, SHORTER_PULL_RETRIES):
            raise FlowerPatchError(
                f"flwr.supercore.inflatable.inflatable_utils.{fn.__name__}: expected the retry "
                f"defaults {EXPECTED_PULL_RETRIES}, found {current}; review clients/flower_patch.py"
            )
    for fn in functions:
        fn.__kwdefaults__.update(SHORTER_PULL_RETRIES)


def sleep_calls(source: str) -> list[str]:
    """The ``sleep(...)`` calls in ``source``, as written."""
    return re.findall(r"\b[\w.]*sleep\([^)]*\)", source)


def check_upstream(module: ModuleType) -> None:
    """Refuse unless ``module``'s sleeps are exactly :data:`EXPECTED_SLEEPS`, through ``time``.

    Raises:
        FlowerPatchError: the calls differ (naming what was found), or the module no longer
            imports ``time`` as a module.
    """
    source = inspect.getsource(module)
    found = sleep_calls(source)
    if tuple(found) != EXPECTED_SLEEPS:
        raise FlowerPatchError(
            f"{module.__name__} ({getattr(module, '__file__', '?')}): expected the sleeps "
            f"{list(EXPECTED_SLEEPS)}, found {found}; this Flower is not the pinned range "
            "(flwr>=1.38,<1.40): review clients/flower_patch.py against its SuperNode loop"
        )
    current = getattr(module, "time", None)
    if current is not time and not isinstance(current, _ShortSleeps):
        raise FlowerPatchError(f"{module.__name__} no longer imports the time module as `time`")
    if [source.count(line) for line in EXPECTED_LAUNCH] != [1, 1]:
        raise FlowerPatchError(
            f"{module.__name__}: expected the SuperExec launch {list(EXPECTED_LAUNCH)} once each; "
            "review clients/flower_patch.py against this Flower's SuperNode"
        )
    current = getattr(module, "subprocess", None)
    if current is not subprocess and not isinstance(current, _WarmSuperExec):
        raise FlowerPatchError(f"{module.__name__} no longer imports the subprocess module as `subprocess`")


def shorten_supernode_sleeps() -> None:
    """Patch the installed SuperNode loop's sleeps (idempotent). Raises :class:`FlowerPatchError`."""
    from flwr.supernode import start_client_internal as loop

    check_upstream(loop)
    loop.time = _ShortSleeps(SHORTER_SLEEPS)  # type: ignore[assignment]


def use_warm_superexec() -> None:
    """Make the installed SuperNode start :mod:`clients.warm_superexec` (idempotent)."""
    from flwr.supernode import start_client_internal as loop

    check_upstream(loop)
    loop.subprocess = _WarmSuperExec()  # type: ignore[assignment]
