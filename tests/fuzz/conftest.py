"""What the partition fuzzers share: one valid partition folder, a way to re-checksum a copy, and
a derandomized Hypothesis profile."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

from retexo_fl.data.partition import save_partition
from retexo_fl.data.partitioners import partition_graph

# CI draws the same cases every run: a failure there is a bug to fix, never a new random draw
# that a rerun hides. HYPOTHESIS_PROFILE=explore draws fresh cases (and finds new ones) locally.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def good_partition(tmp_path_factory) -> Path:
    """A valid partition folder (client 1 of a 120-node generated graph); copy it before changing it."""
    from retexo_fl.data.datasets import apply_split, synthetic_sbm

    data = synthetic_sbm(120, 3, avg_degree=6, homophily=0.8, num_features=5, seed=3)
    apply_split(data, "random:0.4,0.2,0.4", seed=3)
    part = partition_graph(data, 3, "metis", seed=0)[1]
    return save_partition(part, tmp_path_factory.mktemp("good") / "part-1")


def _reseal(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    for name in m["checksums"]:
        m["checksums"][name] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.fixture(scope="session")
def reseal() -> Callable[[Path], None]:
    """Recompute a folder's checksums, as an adversary who writes the manifest too would."""
    return _reseal
