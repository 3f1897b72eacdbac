"""``bench/gpu.py``'s plumbing, on any machine: what a GPU session depends on before its first row."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GPU), *args], capture_output=True, text=True, timeout=timeout, cwd=GPU.parents[1]
    )


def test_an_unknown_section_is_refused_before_any_section_runs(tmp_path):
    done = _run("--out", str(tmp_path / "out"), "--device", "cpu", "--sections", "env,shared_gpu")
    assert done.returncode == 2 and "unknown section(s) shared_gpu" in done.stderr
    assert not (tmp_path / "out").exists()  # env did not run first


def test_the_env_row_names_what_the_host_lacks(tmp_path):
    done = _run("--out", str(tmp_path), "--device", "cpu", "--sections", "env", "--quick")
    assert done.returncode == 0, done.stderr
    (env,) = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert env["section"] == "env"
    for key in ("missing_modules", "missing_tools"):
        assert isinstance(env[key], list)
    # a module this host has is not named, and the table's first lines say what is missing
    assert "cryptography" not in env["missing_modules"]
    lacking = env["missing_modules"] + env["missing_tools"]
    assert ("missing on this host" in done.stdout) == bool(lacking)


def test_large_runs_last_so_it_cannot_starve_the_sections_after_it():
    # Loaded under a name of its own, and the import path put back: gpu.py puts bench/ on it.
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", GPU)
    gpu = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(gpu)
    finally:
        sys.path[:] = saved
    assert list(gpu.SECTIONS)[-1] == "large"
