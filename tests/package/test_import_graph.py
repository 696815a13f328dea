"""No import cycle in amp_tui: the graph is read from the sources with `ast` (nothing is imported,
so torch stays out), every `import` and `from ... import` counted wherever it stands: at the top,
inside a function (a lazy import still closes a cycle once both ends have run), under
`if TYPE_CHECKING:` (a cycle for the type checker and the reader all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "amp_tui"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its `__init__`)."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_names(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (the text of `module`) imports anywhere in it."""
    here = module if is_package else module.rpartition(".")[0]   # what a relative import starts from
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from pkg import name`: the module pkg.name when there is one, else pkg itself.
                submodule = f"{base}.{alias.name}"
                out.add(submodule if submodule in known else base)
    return out & known


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root)
    known = set(modules)
    return {name: imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", known)
            for name, path in modules.items()}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of `graph` that hold a cycle (Tarjan's algorithm): within
    each, every module imports every other one, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []

    def visit(node: str) -> None:
        # Iterative, so that a long chain of imports can't reach the recursion limit.
        work = [(node, iter(sorted(graph.get(node, ()))))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[current] = min(low[current], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[current])
                if low[current] == index[current]:
                    part = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.add(member)
                        if member == current:
                            break
                    if len(part) > 1 or current in graph.get(current, ()):
                        parts.append(part)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return parts


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each tangle: its modules in import order, the first repeated at the end."""
    return [one_cycle(graph, part) for part in tangles(graph)]


def one_cycle(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """A shortest cycle through the first module of `part` (breadth first, inside `part`)."""
    start = min(part)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph.get(node, set()) & part):
                if successor == start:
                    path = [node]   # back from the last module to start
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(part)}")


# ---- the detector itself ----------------------------------------------------------------------------

def test_cycles_finds_a_planted_cycle_and_names_it_in_order():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_imported_names_resolves_relative_imports_submodules_and_lazy_imports():
    known = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.other", "pkg.top"}
    source = (
        "from . import other\n"            # a module of the same package
        "from .. import top, VALUE\n"     # a module one up, and a name of the package itself
        "def later():\n"
        "    import pkg.sub\n"            # a lazy import counts too
        "    from pkg.sub.mod import f\n"
        "import torch\n")                 # outside the package: no edge
    assert imported_names(source, "pkg.sub.mod", False, known) == {
        "pkg.sub.other", "pkg.top", "pkg", "pkg.sub", "pkg.sub.mod"}
    assert imported_names("from .mod import f\n", "pkg.sub", True, known) == {"pkg.sub.mod"}


def test_a_cycle_planted_in_a_package_fails(tmp_path):
    root = tmp_path / "planted"
    (root / "inner").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "inner" / "__init__.py").write_text("")
    (root / "inner" / "one.py").write_text("def f():\n    from planted.inner import two\n")
    (root / "inner" / "two.py").write_text("from . import one\n")
    assert cycles(import_graph(root)) == [["planted.inner.one", "planted.inner.two", "planted.inner.one"]]


# ---- amp_tui ----------------------------------------------------------------------------------------

def test_amp_tui_has_no_import_cycle():
    graph = import_graph()
    assert "amp_tui.cli.train" in graph and "amp_tui.job.run" in graph   # the graph was read at all
    found = []
    for part in tangles(graph):
        cycle = one_cycle(graph, part)
        others = sorted(part - set(cycle))
        found.append(" -> ".join(cycle) + (f" (the same tangle holds {', '.join(others)})" if others else ""))
    assert not found, "import cycles:\n" + "\n".join(found)
