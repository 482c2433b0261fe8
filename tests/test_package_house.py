"""The package's shape: no import circle between its modules, no module over 500 lines.

Both are read from the source (``ast``), nothing is imported. An import inside a function, or
under ``if TYPE_CHECKING:``, runs after every module has loaded and is not counted.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "genlm_vlm"
MAX_LINES = 500


def _modules(package: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module body runs (``if``/``try`` blocks included, function
    bodies and ``if TYPE_CHECKING:`` blocks left out)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                test = node.test
                if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                    visit(node.orelse)
                else:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)

    visit(tree.body)
    return found


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules whose body must have run for its own body to run.

    ``from . import x`` needs the submodule ``x`` when there is one, else the package's
    ``__init__`` (a name defined there). A submodule importing a sibling needs the sibling only:
    its parent package is already initialising then, which is no circle.
    """
    modules = _modules(package)
    root = package.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    prefix = here[: len(here) - (node.level - 1)]
                    base = ".".join([*prefix, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name and t.split(".")[0] == root}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle_and_ignores_lazy_and_parent_imports(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                              "def f():\n    from .a import A\nB = 2\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("try:\n    from pkg.c import x\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("from .e import E\n")
    (pkg / "sub" / "e.py").write_text("from ..a import A\nfrom .f import F\nE = 1\n")
    (pkg / "sub" / "f.py").write_text("F = 1\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == set()  # TYPE_CHECKING and in-function imports do not count
    assert graph["pkg.sub.e"] == {"pkg.a", "pkg.sub.f"}  # the parent package is no dependency
    assert cycles(graph) == [["pkg.c", "pkg.d"]]


def test_no_import_circle_between_the_package_modules() -> None:
    found = cycles(import_graph(PACKAGE))
    assert not found, "module-level import circles (make one side import lazily, or move the shared part):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_module_over_500_lines() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the package
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by role): {over}"


def test_readme_is_at_most_200_lines_and_starts_with_the_demo_and_the_tests() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    n = len(readme.splitlines())
    assert n <= 200, f"README.md has {n} lines: move detail into docs/ and link to it"
    block = readme[readme.index("```bash\n") + 8 :]
    commands = [line.split("#")[0].strip() for line in block[: block.index("```")].splitlines()]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
