"""Shared fixtures: Cora copied out of ../shared, small synthetic graphs, quiet env for Flower."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# The compiled codec loops of this run (and of the servers it starts) go to a folder of its own,
# removed when the run ends.
if "RETEXO_FL_KERNEL_CACHE" not in os.environ:
    os.environ["RETEXO_FL_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="retexo-fl-kernels-")
    atexit.register(shutil.rmtree, os.environ["RETEXO_FL_KERNEL_CACHE"], ignore_errors=True)

# Under ``pytest -n N`` each process gets its share of the cores as torch threads, and so do the
# servers, nodes and workers it starts (they read OMP_NUM_THREADS): two processes of torch's
# default two threads on 2 cores made OpenMP's threads wait on each other, and a test of many
# small steps (a resume at every message) took 195 s beside a busy process instead of 33 s with
# one thread (13 s on an idle machine). Tests that need another count set it themselves.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("MKL_NUM_THREADS", str(_share))


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist process takes the thread share set above (torch reads OMP_NUM_THREADS when
    it is first imported, which a plugin may have done before this file)."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run first, in their order, then the rest: ``pytest -n 2 --dist
    loadgroup`` hands tests out a few at a time in this order (an ``xdist_group`` whole, and
    first), so the long ones start while the short ones fill the gaps, instead of one process
    ending the suite alone with them. Tests
    marked ``cuda`` need a CUDA device: skipped without one, each saying so (``bench/gpu.py`` runs
    exactly these, ``-m cuda``, and counts any skipped there as not run)."""
    import torch

    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def node_work_dir(tmp_path_factory, monkeypatch) -> Path:
    """Every test's Flower nodes keep their state (and cached partitions) in a folder of its own,
    never in the temp folder's ``retexo-fl/`` that every other run on the machine shares."""
    try:
        from clients.node import WORK_DIR_ENV
    except ImportError:  # a bare GPU host without Flower runs the device tests alone
        return tmp_path_factory.mktemp("nodes")
    folder = tmp_path_factory.mktemp("nodes")
    monkeypatch.setenv(WORK_DIR_ENV, str(folder))
    return folder


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """Every test starts with the process's torch thread count: a run with ``threads=1`` sets it
    for the whole process (``torch.set_num_threads``), and the tests after it in that process
    would run, and check the codec's thread split, on one thread."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A private copy of the shared Planetoid raw files (PyG writes processed/ beside raw/)."""
    src = SHARED / "Planetoid"
    if not src.is_dir():
        pytest.skip(f"shared datasets not found at {src}")
    root = tmp_path_factory.mktemp("datasets")
    for name in ("Cora", "CiteSeer"):
        shutil.copytree(src / name / "raw", root / "Planetoid" / name / "raw")
    return root


@pytest.fixture(scope="session")
def cora(data_root):
    from retexo_fl.data.datasets import load_dataset

    return load_dataset("Cora", data_root)


@pytest.fixture(scope="session")
def sbm():
    """600 nodes, 3 classes: features weak on their own, structure strong."""
    from retexo_fl.data.datasets import apply_split, synthetic_sbm

    data = synthetic_sbm(600, 3, avg_degree=8, homophily=0.85, num_features=16, feature_signal=0.35, seed=1)
    apply_split(data, "random:0.3,0.2,0.5", seed=1)
    return data


@pytest.fixture()
def reloading_app(monkeypatch):
    """The ClientApp of ``reloading_clientapp.py``: every process loads node 2's saved state
    before each message, so a test that corrupts it sees the load fail. Flower's simulation
    workers import it by name, as they import ours."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    import reloading_clientapp

    return reloading_clientapp.app
