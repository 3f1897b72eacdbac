"""Flower's SuperExec, launching each ClientApp process as a fork of a warm one.

    python -m clients.warm_superexec <flower-superexec flags>

Flower's SuperExec starts ``flwr-clientapp`` as a new interpreter for every message: about 1.5 s
of CPU for Python and Flower's imports before the app runs (measured on these machines), paid by
every node in every round. Here the SuperExec is Flower's own
(``flower-superexec``'s code, flags and loop), with one change: a ClientApp task is launched by
a ``multiprocessing`` fork server that imported Flower's ClientApp runtime once
(:data:`PRELOAD`). Each message still gets its own process running Flower's
``run_clientapp`` (its own token, its FAB installed and its app loaded as Flower does), so a
ClientApp keeps Flower's isolation; it only skips the interpreter start and the imports. The app
module itself is not preloaded: it comes from the run's FAB. Other task types launch as Flower
launches them.

``retexo-fl supernode`` starts this instead of ``flower-superexec``
(:func:`clients.flower_patch.use_warm_superexec`).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from flwr.supercore.constant import ExecutorType, TaskType
from flwr.supercore.superexec.executor import LaunchResult
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec

#: What the fork server imports once: Flower's ClientApp runtime and the libraries every app of
#: ours uses (not the app: that is the run's FAB's).
PRELOAD = [
    "flwr.supernode.runtime.run_clientapp", "flwr.clientapp", "flwr.app", "httpx", "httpcore", "numpy",
]  # fmt: skip


def run_clientapp_task(spec: ExecutionSpec) -> None:
    """What ``flwr-clientapp --token ...`` runs, in a forked process."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    from clients.flower_patch import shorten_object_pulls

    shorten_object_pulls()
    # The app comes from the run's FAB, as in `flwr-clientapp`: forget the installed package this
    # function was loaded from, so that loading `clients.app` finds the FAB's copy.
    for name in [m for m in sys.modules if m == "clients" or m.startswith("clients.")]:
        del sys.modules[name]

    run_clientapp(
        runtime_api_address=spec.runtime_api_address,
        token=spec.token,
        insecure=spec.insecure,
        certificates=validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
        parent_pid=spec.parent_pid,
        runtime_dependency_install=spec.runtime_dependency_install,
    )


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
