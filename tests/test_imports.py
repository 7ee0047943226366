"""distrl's modules import each other without a cycle, deferred imports included: imports flow one way
(CONTRIBUTING.md), and a circle (two modules each needing the other) is the first sign of a responsibility in the
wrong place."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "distrl"


def import_graph(package: Path) -> nx.DiGraph:
    """Module -> the modules of `package` it imports anywhere in its code (inside functions too)."""
    top = package.name

    def name_of(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in package.rglob("*.py")}

    def owner(name: str) -> str:  # `from distrl.workers import fingerprint` names a module; else the package's
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == top:
                targets = [owner(f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names if a.name.split(".")[0] == top]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t != name)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_distrl_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert graph.has_edge("distrl.workers.rollout.worker", "distrl.workers.training.lora")  # a deferred import is seen
    assert cycles(graph) == []


def test_a_cycle_through_a_deferred_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
