"""Fixtures of the node tests: worker folders short enough for a Unix socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def short_dir() -> Iterator[Path]:
    """A new folder of this test's own in the temp folder, removed after it. A worker's socket
    path must stay under ``MAX_SOCKET_PATH`` bytes, which pytest's ``tmp_path`` (named after
    the test, one level deeper under ``pytest -n``) can pass."""
    base = Path(tempfile.mkdtemp(prefix="rfw-"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def worker_base() -> Iterator[Path]:
    """Where a test makes its worker folders (:func:`short_dir`)."""
    with short_dir() as base:
        yield base


@pytest.fixture(scope="module")
def module_worker_base() -> Iterator[Path]:
    """The same for a module's shared workers."""
    with short_dir() as base:
        yield base
