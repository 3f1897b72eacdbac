"""The layout's rules, checked: one round body, a library that never reaches up into the apps,
two wings (party, coordinator) that never import each other, and no import cycles
(tools/import_cycles.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sources(*folders: str) -> dict[Path, str]:
    return {p: p.read_text() for f in folders for p in (ROOT / f).rglob("*.py")}


def test_one_round_body():
    # Every mode's rounds run RoundLoop; FedAvg's aggregation is one hook of the seam it drives.
    def callers(pattern: str) -> list[str]:
        return [
            p.relative_to(ROOT).as_posix()
            for p, text in _sources("retexo_fl", "server", "clients").items()
            for _ in re.finditer(pattern, text)
        ]

    assert callers(r"(?<!def )\baggregate_round\(") == ["retexo_fl/coordinator/round_aggregation.py"]
    assert callers(r"(?<!def )\bround_aggregation\(") == ["retexo_fl/coordinator/round_loop.py"]


def test_the_library_imports_nothing_from_the_apps():
    reaching = [
        p.relative_to(ROOT).as_posix()
        for p, text in _sources("retexo_fl").items()
        if re.search(r"^\s*(from (server|clients)\b|import (server|clients)\b)", text, re.M)
    ]
    assert reaching == []


def test_the_library_imports_no_flower_transport():
    # Flower's DP helpers are allowed (retexo_fl/coordinator/privacy.py); its messaging is not.
    pattern = r"^\s*from flwr\.(app|serverapp|clientapp|simulation|server|client)\b"
    assert [p.name for p, text in _sources("retexo_fl").items() if re.search(pattern, text, re.M)] == []


def _imported_modules(text: str) -> set[str]:
    """The modules a source imports (top level or inside functions), absolute names only."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_party_and_coordinator_never_import_each_other():
    # The wings exchange messages (retexo_fl/protocol.py) and share record types
    # (retexo_fl/records.py); neither may reach into the other, not even inside a function.
    crossing = []
    for wing, other in (("party", "coordinator"), ("coordinator", "party")):
        for path, text in _sources(f"retexo_fl/{wing}").items():
            bad = sorted(m for m in _imported_modules(text) if m.startswith(f"retexo_fl.{other}"))
            crossing += [f"{path.relative_to(ROOT).as_posix()} imports {m}" for m in bad]
    assert crossing == []
    # The ClientApp side stays on the party wing, the ServerApp side on the coordinator's.
    for app, other in (("clients", "coordinator"), ("server", "party")):
        reaching = [
            f"{path.relative_to(ROOT).as_posix()} imports {m}"
            for path, text in _sources(app).items()
            for m in sorted(_imported_modules(text))
            if m.startswith(f"retexo_fl.{other}")
        ]
        assert reaching == [], app


def test_the_wing_check_sees_an_import_inside_a_function():
    text = "def f():\n    from retexo_fl.coordinator.federation import FederationView\n"
    assert "retexo_fl.coordinator.federation" in _imported_modules(text)
    assert "retexo_fl.party" in _imported_modules("from retexo_fl import party\n")


def test_no_import_cycles():
    for package in ("retexo_fl", "clients", "server"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "import_cycles.py"), package],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout


def test_the_cycle_check_finds_cycles(tmp_path):
    """A package whose modules import each other (one inside a function), and whose
    subpackages import each other through different modules: both are reported."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_cycles
    finally:
        sys.path.remove(str(ROOT / "tools"))
    pkg = tmp_path / "pkg"
    for name, text in {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from . import a\n",
        "x/__init__.py": "",
        "x/one.py": "import pkg.y.two\n",
        "y/__init__.py": "",
        "y/two.py": "",
        "y/three.py": "from pkg.x import one\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = import_cycles.import_graph(pkg)
    assert import_cycles.module_cycles(graph) == [["pkg.a", "pkg.b"]]
    # first-level modules are units too: the module cycle shows at that level as well
    assert import_cycles.package_cycles(graph) == [("pkg.a", "pkg.b"), ("pkg.x", "pkg.y")]
    assert import_cycles.main([str(pkg)]) == 1


def _imports(module: str, *names: str) -> list[bool]:
    code = f"import sys, {module}; print([n in sys.modules for n in {list(names)!r}])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout)


def test_the_clientapp_does_not_import_pyg():
    # A deployed ClientApp without a node worker is a new process per message: PyG's ~2 s
    # import would be paid by every message (it doubled a deployed round). Only conv stages and
    # dataset cutting need it.
    assert _imports("clients.node_client", "torch_geometric") == [False]


def test_the_clientapp_shim_imports_no_torch():
    # With a node worker, each message's ClientApp process only forwards; torch (about 2 s) is
    # the worker's. The module that answers without a worker is imported only when it is used.
    assert _imports("clients.app", "torch", "torch_geometric", "clients.node_client") == [False, False, False]
    assert _imports("clients.mods", "torch") == [False]


def test_every_setting_is_documented():
    """Each setting a user can give appears in README.md or docs/ by its flag or key: two had
    only their --help line (a new user's walkthrough found them)."""
    from retexo_fl.config import settings

    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    missing = [
        info.key
        for info in settings()
        if f"--{info.key}" not in text and f"`{info.key}`" not in text and f"{info.key}=" not in text
    ]
    assert missing == []
