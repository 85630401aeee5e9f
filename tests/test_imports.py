"""The package's import graph: no cycles, and ``import eplb`` stays light.

Every import statement counts (top level, inside functions, under ``TYPE_CHECKING``): a cycle that
only a lazy import hides still ties two modules into one concern. Imports by name through
``importlib`` (the lazy registries) are not edges.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for base, prefix in ((ROOT / "eplb", ("eplb",)), (ROOT / "kernels", ("eplb", "kernels"))):
        for path in base.rglob("*.py"):
            parts = [*prefix, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    files = _module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in files:
                        graph[name].add(full)
                    elif node.module in files:
                        graph[name].add(node.module)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "eplb.placement.model" in graph and "eplb.kernels.remap_record" in graph
    assert find_cycles(graph) == []


def test_import_eplb_loads_no_heavy_stack() -> None:
    code = (
        "import sys, eplb; eplb.__all__; "
        "print(sorted(m for m in ('torch', 'triton', 'scipy', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves() -> None:
    code = "import eplb; [getattr(eplb, n) for n in eplb.__all__]; print(len(eplb.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 30
