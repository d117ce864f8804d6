"""Which part of seerd may import which, read from the source: every import counts, at module
level, inside functions and under TYPE_CHECKING (a lazy import is still a dependency, and a
TYPE_CHECKING one still ties two modules together). A failure lists each offending import as
`importer -> imported (file:line)`, so it says what to move."""

from __future__ import annotations

import ast
import functools
import os
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int
    where: str = ""  # "in a function", "under TYPE_CHECKING", or "" at module level

    def __str__(self) -> str:
        where = f", {self.where}" if self.where else ""
        return f"{self.importer} -> {self.imported} ({self.path.relative_to(REPO)}:{self.line}{where})"


def module_files() -> dict[str, Path]:
    """Every module under seerd/ by dotted name (followlinks: seerd/migrations links to migrations/)."""
    found = {}
    for folder, subfolders, files in os.walk(REPO / "seerd", followlinks=True):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = path.relative_to(REPO).with_suffix("").parts
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_in(module: str, path: Path, modules: Iterable[str]) -> Iterator[Import]:
    """The seerd modules `module` imports. `from a import b` imports a.b when that is a module,
    else a (b is a name in it). Importing a.b counts as importing a.b only, not its package a
    (which Python runs first): else every package whose __init__ imports its modules were a cycle."""
    known = set(modules)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node, where in _import_statements([ast.parse(path.read_text(), str(path))]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([source] if source else [])])
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        for target in targets:
            if in_package(target, "seerd"):
                yield Import(module, target, path, node.lineno, where)


def _import_statements(nodes: Iterable[ast.AST], where: str = "") -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement in or below `nodes`, with where it stands."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _import_statements(ast.iter_child_nodes(node), "in a function")
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_statements(node.body, "under TYPE_CHECKING")
            yield from _import_statements(node.orelse, where)
        else:
            yield from _import_statements(ast.iter_child_nodes(node), where)


def _is_type_checking(test: ast.expr) -> bool:  # `TYPE_CHECKING` or `typing.TYPE_CHECKING`
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def import_graph() -> tuple[Import, ...]:
    modules = module_files()
    found = {imp: None for module, path in sorted(modules.items()) for imp in imports_in(module, path, modules)}
    return tuple(found)  # each (importer, imported, line) once, in file order


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_from(importers: str, imported: str, *, except_within: str | None = None) -> list[Import]:
    return [found for found in import_graph()
            if in_package(found.importer, importers) and in_package(found.imported, imported)
            and not (except_within and in_package(found.imported, except_within))]


def fail_if_any(found: list[Import], what: str) -> None:
    if found:
        pytest.fail(f"{what}:\n" + "\n".join(f"  {imp}" for imp in found), pytrace=False)


def cycles(edges: Iterable[Import]) -> list[list[Import]]:
    """Per strongly connected group of modules (Tarjan): every import inside the group, those of
    its shortest cycle first."""
    edges = list(edges)
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for edge in edges:
        graph[edge.importer].setdefault(edge.imported, edge)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (~150)
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            groups.append(group)

    for node in sorted(graph):
        if node not in order:
            visit(node)
    found = []
    for group in groups:
        start = min(group)
        if len(group) == 1 and start not in graph.get(start, {}):
            continue
        cycle = _shortest_cycle(graph, start, group)
        inside = [edge for edge in edges
                  if edge.importer in group and edge.imported in group and edge not in cycle]
        found.append(cycle + inside)
    return sorted(found, key=lambda group_edges: group_edges[0].importer)


def _shortest_cycle(graph: dict[str, dict[str, Import]], start: str, group: set[str]) -> list[Import]:
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt, edge in sorted(graph[node].items()):
            if nxt == start:
                path = [edge]
                while path[0].importer != start:
                    path.insert(0, came_by[path[0].importer])
                return path
            if nxt in group and nxt not in came_by:
                came_by[nxt] = edge
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # cannot happen inside a strongly connected group


def describe(group_edges: list[Import]) -> str:
    modules = sorted({edge.importer for edge in group_edges})
    return (f"  among {', '.join(modules)}; the imports inside:"
            + "".join(f"\n    {edge}" for edge in group_edges))


def test_the_graph_is_read():
    graph = {(found.importer, found.imported) for found in import_graph()}
    assert ("seerd.cli.main", "seerd.config") in graph
    assert ("seerd.db.migrate", "seerd.migrations") in graph  # `from seerd import migrations`
    assert ("seerd.migrations.env", "seerd.db") in graph  # through the symlink
    where = {(found.importer, found.imported): found.where for found in import_graph()}
    assert where["seerd.launch.prepare", "seerd.coordinator.daemon"] == "in a function"
    assert where["seerd.cli.launching", "seerd.coordinator.daemon"] == "under TYPE_CHECKING"


def test_the_cycle_finder_names_a_cycle():
    here = Path(__file__)
    edges = [Import(a, b, here, n) for n, (a, b) in enumerate([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])]
    assert [[(e.importer, e.imported) for e in cycle] for cycle in cycles(edges)] == [
        [("a", "b"), ("b", "c"), ("c", "a")]]
    assert cycles(edges[:2]) == []
    both_ways = [*edges, Import("b", "a", here, 9)]
    assert [(e.importer, e.imported) for e in cycles(both_ways)[0]] == [
        ("a", "b"), ("b", "a"), ("b", "c"), ("c", "a")]  # the shortest cycle first, then the rest inside


@pytest.mark.parametrize("importer", ["seerd.status", "seerd.sim", "seerd.worker"])
@pytest.mark.parametrize("daemon_part", ["seerd.coordinator", "seerd.book", "seerd.server"])
def test_readers_simulator_and_workers_never_import_the_daemon(importer, daemon_part):
    fail_if_any(imports_from(importer, daemon_part), f"{importer} imports {daemon_part}")


def test_the_book_knows_nothing_of_the_server_or_the_run_lifecycle():
    fail_if_any(imports_from("seerd.book", "seerd.server") + imports_from("seerd.book", "seerd.coordinator"),
                "seerd.book imports the server or the coordinator")


def test_the_server_knows_nothing_of_the_run_lifecycle():
    fail_if_any(imports_from("seerd.server", "seerd.coordinator"), "seerd.server imports the coordinator")


def test_the_simulator_uses_the_scheduler_the_protocol_and_the_draft_depth_policy_only():
    # sim -> drafts is allowed for the workers' depth planner (pure, imports nothing from seerd), so
    # `+sd` policies run the workers' own code; never the drafter or its client (vLLM, HTTP).
    allowed = ("seerd.sim", "seerd.scheduler", "seerd.protocol", "seerd.tail", "seerd.drafts.policy")
    fail_if_any([found for found in imports_from("seerd.sim", "seerd")
                 if not any(in_package(found.imported, package) for package in allowed)],
                "seerd.sim imports more than the scheduler, the protocol, seerd.tail and seerd.drafts.policy")


def test_status_does_not_import_the_scheduler():
    # Issue 14: status reads the coordinator's forecast (persisted or served), not the scheduler's code.
    fail_if_any(imports_from("seerd.status", "seerd.scheduler"), "seerd.status imports the scheduler")


def test_the_scheduler_imports_nothing_else_from_seerd():
    fail_if_any(imports_from("seerd.scheduler", "seerd", except_within="seerd.scheduler"),
                "seerd.scheduler imports other parts of seerd")


def test_the_wire_protocol_imports_nothing_else_from_seerd_but_the_settings_it_carries():
    # Workers, engine processes and the coordinator all load it: it must stay light.
    fail_if_any([found for found in imports_from("seerd.protocol", "seerd", except_within="seerd.protocol")
                 if found.imported != "seerd.settings"], "seerd.protocol imports other parts of seerd")
    fail_if_any(imports_from("seerd.settings", "seerd", except_within="seerd.settings"),
                "seerd.settings imports other parts of seerd")


def test_launch_does_not_import_the_cli():
    fail_if_any(imports_from("seerd.launch", "seerd.cli"), "seerd.launch imports the CLI")


def test_kvpool_does_not_import_launch():
    fail_if_any(imports_from("seerd.kvpool", "seerd.launch"), "seerd.kvpool imports seerd.launch")


def test_no_import_cycles():
    found = cycles(import_graph())
    if found:
        pytest.fail("import cycles, per group of modules that import each other (the first imports listed "
                    "close one cycle):\n" + "\n".join(map(describe, found)), pytrace=False)


def test_only_the_db_package_imports_sqlalchemy_or_sqlite3():
    """SQL has one home: statements and queries live in `seerd.db` (`seerd.db.queries` for the
    rest of seerd), and the Alembic migrations beside it; every other module holds a connection
    or a session without building SQL."""
    found = []
    for module, path in sorted(module_files().items()):
        if in_package(module, "seerd.db") or in_package(module, "seerd.migrations"):
            continue
        for node, where in _import_statements([ast.parse(path.read_text(), str(path))]):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in ("sqlalchemy", "sqlite3"):
                    found.append(f"  {module} -> {name} ({path.relative_to(REPO)}:{node.lineno}{', ' + where if where else ''})")
    if found:
        pytest.fail("modules outside seerd.db import SQL libraries:\n" + "\n".join(found), pytrace=False)


MAX_MODULE_LINES = 500  # ../shared/DESIGN.md: small modules
MAX_FUNCTION_LINES = 80  # in the daemon's own packages, whose middle is the hardest to read


def test_modules_stay_small():
    big = [f"  {path.relative_to(REPO)}: {lines} lines" for path in sorted(set(module_files().values()))
           if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    if big:
        pytest.fail(f"modules over {MAX_MODULE_LINES} lines (split them along a noun or a step):\n" + "\n".join(big),
                    pytrace=False)


def test_the_daemons_functions_stay_short():
    long = []
    for module, path in sorted(module_files().items()):
        if not any(in_package(module, package) for package in ("seerd.coordinator", "seerd.server", "seerd.book")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (lines := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long.append(f"  {module}.{node.name} ({path.relative_to(REPO)}:{node.lineno}): {lines} lines")
    if long:
        pytest.fail(f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long), pytrace=False)
