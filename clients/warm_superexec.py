"""Flower's SuperExec, launching each ClientApp process as a fork of a warm one.

    python -m clients.warm_superexec <flower-superexec flags>

Flower's SuperExec starts ``flwr-clientapp`` as a new interpreter for every message: about 1.5 s
of CPU for Python and Flower's imports before the app runs (measured on these machines), paid by
every node in every round. Here the SuperExec is Flower's own
(``flower-superexec``'s code, flags and loop), with one change: a ClientApp task is launched by
a ``multiprocessing`` fork server that imported Flower's ClientApp runtime once
(:data:`PRELOAD`). Each message still gets its own process running Flower's
``run_clientapp`` (its own token and its own context), so a ClientApp keeps Flower's isolation;
it skips the interpreter start and the imports. The other change is whose code answers: the
party's installed app, unless the run's FAB carries a release signature by an entity the party
trusts (:func:`approve_apps`, :mod:`clients.approval`); a FAB that is neither is refused before
any of it runs. Other task types launch as Flower launches them.

``retexo-fl supernode`` starts this instead of ``flower-superexec``
(:func:`clients.flower_patch.use_warm_superexec`).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any

from flwr.supercore.constant import ExecutorType, TaskType
from flwr.supercore.superexec.executor import LaunchResult
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec

from clients.approval import TRUSTED_ENTITIES_ENV, Approval, approve, load_app
from clients.flower_patch import FlowerPatchError

#: What the fork server imports once: Flower's ClientApp runtime, the libraries every app of
#: ours uses, and the installed app (the one that answers, unless a trusted entity signed another).
PRELOAD = [
    "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.app", "httpx", "httpcore", "numpy",
    "clients.app", "clients.approval", "yaml",
]  # fmt: skip


def run_clientapp_task(spec: ExecutionSpec) -> None:
    """What ``flwr-clientapp --token ...`` runs, in a forked process, answering with an approved app.

    Flower's ``run_clientapp`` runs unchanged except for two of its names, swapped in this process
    only (:func:`approve_apps`): installing the run's FAB first checks it
    (:func:`clients.approval.approve`), and loading the ClientApp loads the installed app unless
    a trusted entity signed the FAB's. Runtime dependency installation is off: a party's
    dependencies are the ones it installed.
    """
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime import run_clientapp as runtime

    from clients.flower_patch import shorten_object_pulls

    shorten_object_pulls()
    approve_apps(runtime, os.environ.get(TRUSTED_ENTITIES_ENV) or None)
    runtime.run_clientapp(
        runtime_api_address=spec.runtime_api_address,
        token=spec.token,
        insecure=spec.insecure,
        certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
        parent_pid=spec.parent_pid,
        runtime_dependency_install=False,
    )


#: The lines of Flower's ``run_clientapp`` that :func:`approve_apps` relies on, once each.
EXPECTED_RUNTIME_CALLS = (
    "install_from_fab(fab.content, skip_prompt=True)",
    "load_client_app_fn = get_load_client_app_fn(",
    "client_app: ClientApp = load_client_app_fn(",
)


def approve_apps(runtime: ModuleType, trusted_entities: str | None) -> None:
    """Make ``runtime`` (Flower's ``flwr.supernode.runtime.run_clientapp`` module) run only
    approved apps: its ``install_from_fab`` approves first and installs only a signed release, its
    ``get_load_client_app_fn`` loads the installed app for an unsigned one.

    Raises:
        FlowerPatchError: ``runtime`` does not make those calls once each (another Flower).
    """
    source = inspect.getsource(runtime)
    if [source.count(call) for call in EXPECTED_RUNTIME_CALLS] != [1] * len(EXPECTED_RUNTIME_CALLS):
        raise FlowerPatchError(
            f"{runtime.__name__}: expected the calls {list(EXPECTED_RUNTIME_CALLS)} once each; "
            "review clients/warm_superexec.py against this Flower's ClientApp runtime"
        )
    flower_install = getattr(runtime.install_from_fab, "__wrapped__", runtime.install_from_fab)
    flower_loader = getattr(runtime.get_load_client_app_fn, "__wrapped__", runtime.get_load_client_app_fn)
    approved: list[Approval] = []

    def install_from_fab(fab: bytes, *args: Any, **kwargs: Any) -> Any:
        approved.append(approve(fab, trusted_entities))  # raises before anything of it is written
        if approved[-1].runs_installed:
            return None
        print(
            f"running the app signed by {approved[-1].signer!r} ({approved[-1].fab_digest})", file=sys.stderr
        )
        return flower_install(fab, *args, **kwargs)

    def get_load_client_app_fn(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        flower_load = flower_loader(*args, **kwargs)
        return lambda *ref: load_app(approved[-1], flower_load, *ref)

    install_from_fab.__wrapped__ = flower_install  # type: ignore[attr-defined]
    get_load_client_app_fn.__wrapped__ = flower_loader  # type: ignore[attr-defined]
    runtime.install_from_fab = install_from_fab  # type: ignore[attr-defined]
    runtime.get_load_client_app_fn = get_load_client_app_fn  # type: ignore[attr-defined]


def _warm_up() -> None:
    """Nothing: starting it makes the fork server import :data:`PRELOAD` before a message waits."""


class WarmClientAppExecutor(SubprocessExecutor):
    """Flower's subprocess executor, with ClientApp tasks forked from a warm fork server."""

    def __init__(self) -> None:
        super().__init__()
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        self._children: list[BaseProcess] = []
        self._launch(_warm_up)

    def _launch(self, target: Callable[..., None], *args: object) -> None:
        process = self._context.Process(target=target, args=args, daemon=False)
        process.start()
        self._children.append(process)

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """Fork a ClientApp process from the warm server; any other task as Flower does."""
        if spec.task_type != TaskType.CLIENT_APP:
            return super().launch(spec)
        try:
            self._launch(run_clientapp_task, spec)
        except Exception as exc:  # Flower's loop logs a failed launch and lets the task expire
            return LaunchResult.failed(f"fork server: {type(exc).__name__}: {exc}")
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap finished ClientApp processes (``is_alive`` collects their exit status)."""
        self._children = [p for p in self._children if p.is_alive()]


def main() -> None:
    """Run ``flower-superexec`` with :class:`WarmClientAppExecutor` as its subprocess executor."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.superexec import run_superexec as loop

    flower_get_executor = loop.get_executor

    def get_executor(executor_type: ExecutorType, *args: Any, **kwargs: Any) -> Any:
        if executor_type == ExecutorType.SUBPROCESS:
            return WarmClientAppExecutor()
        return flower_get_executor(executor_type, *args, **kwargs)

    loop.get_executor = get_executor
    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
