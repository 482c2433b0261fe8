"""The import graph inside ``genlm_vlm/engine/``: no cycle, and only ``loop.py`` imports ``.steps``.

Pure source check (``ast``): every import counts, those under ``TYPE_CHECKING`` and inside
functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import genlm_vlm.engine

ENGINE = Path(genlm_vlm.engine.__file__).parent
PACKAGE = "genlm_vlm.engine"


def _targets(node: ast.AST, modules: set[str]) -> set[str]:
    """The engine modules one import statement names (``__init__`` for the package itself)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level == 1:
            base = node.module
        elif node.level == 0 and node.module is not None and (node.module + ".").startswith(PACKAGE + "."):
            base = node.module[len(PACKAGE) + 1:] or None
        else:
            return set()  # outside the engine package (``..x``) or another package
        if base is None:  # ``from . import a, b``: submodules, or names of the package
            return {a.name if a.name in modules else "__init__" for a in node.names}
        names = [f"{PACKAGE}.{base}"]
    else:
        return set()
    found = set()
    for name in names:
        if name == PACKAGE:
            found.add("__init__")
        elif name.startswith(PACKAGE + "."):
            found.add(name[len(PACKAGE) + 1:].split(".")[0])
    return found


def engine_import_graph() -> dict[str, set[str]]:
    """Module name (file stem) -> the engine modules it imports."""
    files = sorted(ENGINE.glob("*.py"))
    modules = {f.stem for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            edges |= _targets(node, modules)
        edges.discard(f.stem)
        graph[f.stem] = edges & modules
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_graph_reader_sees_type_checking_and_function_imports():
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import X\n"
        "def f():\n    from . import c\n    import genlm_vlm.engine.d\n"
        "from ..jobs import Y\nfrom genlm_vlm.engine import Z\n"
    )
    found: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        found |= _targets(node, {"b", "c", "d"})
    assert found == {"b", "c", "d", "__init__"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_engine_import_graph_has_no_cycle():
    graph = engine_import_graph()
    assert {"steps", "loop", "bursts", "scoring", "port"} <= graph.keys()
    cycle = find_cycle(graph)
    if cycle:
        print("import cycle in genlm_vlm/engine:", " -> ".join(cycle))
    assert cycle is None, f"import cycle in genlm_vlm/engine: {' -> '.join(cycle or [])}"


def test_only_loop_imports_steps():
    graph = engine_import_graph()
    importers = sorted(m for m, edges in graph.items() if "steps" in edges)
    assert importers == ["loop"], importers


def _port_members() -> set[str]:
    tree = ast.parse((ENGINE / "port.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoopPort")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
        n.name for n in cls.body if isinstance(n, ast.FunctionDef)
    }


def _loop_uses(path: Path) -> set[str]:
    """Attributes read off the loop in ``path``: ``loop.x``, ``self.loop.x``, ``self._loop.x``."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "loop") or (
            isinstance(v, ast.Attribute) and v.attr in ("loop", "_loop")
            and isinstance(v.value, ast.Name) and v.value.id == "self"
        ):
            used.add(node.attr)
    return used


def test_loop_port_is_exactly_what_bursts_and_scoring_use_and_step_loop_has_it():
    from genlm_vlm.engine.steps import StepLoop

    members = _port_members()
    used = _loop_uses(ENGINE / "bursts.py") | _loop_uses(ENGINE / "scoring.py")
    assert used == members, f"used but not in LoopPort: {used - members}; in LoopPort, unused: {members - used}"
    init = next(n for n in ast.walk(ast.parse((ENGINE / "steps.py").read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    missing = sorted(m for m in members if not callable(getattr(StepLoop, m, None)) and m not in assigned)
    assert not missing, f"StepLoop lacks LoopPort members: {missing}"
