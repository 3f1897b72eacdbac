"""Import cycles of a package: every import counts (function-level ones included), between
modules and between the package's first-level subpackages.

    python tools/import_cycles.py retexo_fl     (from the repository root)

Prints each cycle and a count; exits 1 when there is any. ``tests/test_layout.py`` runs it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_files(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its own name, not ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.with_suffix("").relative_to(package.parent).parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: anchored at this module's package
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names] + [base]


def import_graph(package: Path) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``.

    A name resolves to its longest known module prefix (``from a.b import c`` is ``a.b.c`` when
    that is a module, else ``a.b``); a module importing its own package's ``__init__`` is no edge.
    """
    modules = module_files(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, module, path.name == "__init__.py"):
                if target.split(".")[0] != package.name:
                    continue
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of first-level subpackages (``pkg.x``) that import each other."""

    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for v, ws in graph.items():
        for w in ws:
            if top(v) != top(w):
                edges.setdefault(top(v), set()).add(top(w))
    return sorted({tuple(sorted((a, b))) for a, bs in edges.items() for b in bs if a in edges.get(b, ())})


def main(argv: list[str]) -> int:
    """Print the cycles of the package folder ``argv[0]``; 1 if there are any."""
    graph = import_graph(Path(argv[0]))
    cycles, pairs = module_cycles(graph), package_cycles(graph)
    for c in cycles:
        print("module cycle:", " <-> ".join(c))
    for a, b in pairs:
        print("package cycle:", a, "<->", b)
    imports = sum(map(len, graph.values()))
    counts = f"{len(cycles)} module cycle(s), {len(pairs)} package cycle(s)"
    print(f"{len(graph)} modules, {imports} imports, {counts}")
    return 1 if cycles or pairs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
