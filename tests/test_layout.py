"""The layout of ``src/lonnymq`` holds: no import cycle among its modules, the layers import one
way only (Celery/Kombu -> transport -> queue API -> SQL; the command line and the web view
beside the transport, sharing what an operator is shown through ``lonnymq.report``), no
module is over 500 lines, no SQL function of the schema (``sql/schema/``) is over 150, and
every function of the schema has a caller: the Python, a role's grant or another function
(superseded ones are dropped once no supported client calls them, docs/design.md).

The graph is read from the source files with :mod:`ast` (nothing is imported), so it is the
graph of the tree next to this file. Every ``import`` and ``from ... import`` statement counts,
wherever it is: at module level, under ``if TYPE_CHECKING:``, and inside functions. A deferred
import is still a dependency (of the type checker's view, or of the call that runs it), and
hiding one inside a function to get round a circle is a circle all the same.

Run it to see the graph and the sizes::

    python tests/test_layout.py
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "lonnymq"
ROOT = Path(__file__).resolve().parent.parent / "src" / PACKAGE
MAX_LINES = 500
#: Modules not counted against MAX_LINES: the SQL package holds the schema and migrations.
SKIP = ("sql",)
#: Modules over MAX_LINES for now, each with why. An entry whose module shrank below the limit
#: (or went away) fails the test, so that the list only ever gets shorter.
OVER_LIMIT: dict[str, str] = {}
#: The longest a function of the schema may be, from its CREATE FUNCTION to its closing quote.
MAX_SQL_LINES = 150
SQL_DIR = ROOT / "sql" / "schema"
#: A call of a schema function in SQL text: ``{schema}.name(``.
SQL_CALL = re.compile(r"\{schema\}\.(\w+)\s*\(")
#: Functions over MAX_SQL_LINES for now: the length each has today, which it may not pass, and
#: why. As with OVER_LIMIT, an entry that got shorter than its figure must take the new figure
#: (or leave the list once under the limit), so the list only ever shrinks.
SQL_OVER_LIMIT: dict[str, tuple[int, str]] = {}
_CELERY = ("lonnymq.celery", "lonnymq.celery_steps", "lonnymq.celery_cli")
#: What each layer may not import (a module, with its submodules): the queue API nothing above
#: it; the transport neither the command line nor the Celery helpers; the command line, which
#: talks to the queue API directly, not the transport; the web view (which the command line
#: serves) nothing of the transport, the command line or Celery.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "lonnymq.queue": (
        "lonnymq.transport",
        "lonnymq.cli",
        "lonnymq.metrics",
        "lonnymq.web",
        "lonnymq.report",
        *_CELERY,
    ),
    "lonnymq.transport": ("lonnymq.cli", "lonnymq.metrics", "lonnymq.web", *_CELERY),
    "lonnymq.cli": ("lonnymq.transport", *_CELERY),
    "lonnymq.report": ("lonnymq.transport", "lonnymq.cli", "lonnymq.web", *_CELERY),
    "lonnymq.web": ("lonnymq.transport", "lonnymq.cli", "lonnymq.metrics", *_CELERY),
}


@dataclass(frozen=True)
class Edge:
    target: str
    line: int
    #: "module" (a module-level import), "typing" (under ``if TYPE_CHECKING``), or
    #: "function" (inside a function or method)
    where: str


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by the name of its __init__)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """The import statements of a module, each with where it is (see :class:`Edge`)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(nodes: Iterable[ast.AST], where: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append((node, where))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), "function")
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "typing")
                visit(node.orelse, where)
            else:
                visit(ast.iter_child_nodes(node), where)

    visit(tree.body, "module")
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> list[str]:
    """The modules of the package a statement imports (the deepest one that exists: ``from
    .queue import dequeue`` is ``lonnymq.queue.dequeue``, ``from .queue import Broker`` is
    ``lonnymq.queue``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            parts = module.split(".")
            base = parts if is_package else parts[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" for alias in node.names] or [prefix]
        names = [name if name in known else prefix for name in names]
    out = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] == PACKAGE:
            out.append(name)
    return list(dict.fromkeys(out))


def import_graph(root: Path = ROOT) -> dict[str, list[Edge]]:
    """module -> the modules of the package it imports (with where), read from the source."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, list[Edge]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges: dict[str, Edge] = {}
        for node, where in _imports(tree):
            for target in _targets(node, module, path.name == "__init__.py", known):
                if target != module and target not in edges:
                    edges[target] = Edge(target, node.lineno, where)
        graph[module] = sorted(edges.values(), key=lambda e: e.target)
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted: every import cycle is inside one of them (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, []):
            if edge.target not in index:
                connect(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
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

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def line_counts(root: Path = ROOT) -> dict[str, int]:
    """Lines of every module of the package but those under :data:`SKIP`."""
    out = {}
    for module, path in module_files(root).items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in SKIP:
            continue
        out[module] = len(path.read_text(encoding="utf-8").splitlines())
    return out


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "lonnymq.transport" in graph and "lonnymq.cli" in graph  # the walk found the tree
    found = cycles(graph)
    detail = [
        f"{m} -> {e.target} (line {e.line}, {e.where})"
        for component in found
        for m in component
        for e in graph[m]
        if e.target in component
    ]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_layers_import_one_way() -> None:
    graph = import_graph()
    wrong = [
        f"{module} -> {edge.target} (line {edge.line}, {edge.where})"
        for module, edges in graph.items()
        for edge in edges
        for layer, above in FORBIDDEN.items()
        if _within(module, layer) and any(_within(edge.target, a) for a in above)
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_module_over_500_lines() -> None:
    counts = line_counts()
    over = {m: n for m, n in counts.items() if n > MAX_LINES and m not in OVER_LIMIT}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
    stale = {m: counts.get(m) for m in OVER_LIMIT if counts.get(m, 0) <= MAX_LINES}
    assert not stale, f"no longer over {MAX_LINES} lines (take them off OVER_LIMIT): {stale}"


def sql_functions() -> dict[str, list[str]]:
    """The lines of each function of ``sql/schema/``, from its ``CREATE FUNCTION`` to the line
    that closes its dollar-quoted body."""
    functions: dict[str, list[str]] = {}
    for path in sorted(SQL_DIR.glob("*.sql")):
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            match = re.match(r"CREATE FUNCTION \{schema\}\.(\w+)", lines[i])
            if not match:
                i += 1
                continue
            start, tag = i, None
            while i < len(lines):
                rest = lines[i]
                if tag is None and (opened := re.search(r"\$\w*\$", rest)):
                    tag, rest = opened[0], rest[opened.end() :]
                if tag is not None and tag in rest:
                    break
                i += 1
            assert tag is not None, f"{path.name}: {match[1]} has no dollar-quoted body"
            assert match[1] not in functions, f"{match[1]} is created twice"
            functions[match[1]] = lines[start : i + 1]
            i += 1
    return functions


def sql_function_lengths() -> dict[str, int]:
    return {name: len(lines) for name, lines in sql_functions().items()}


def test_no_sql_function_over_150_lines() -> None:
    lengths = sql_function_lengths()
    assert "message_create_v1" in lengths, sorted(lengths)  # the reader found the functions
    over = {
        name: n
        for name, n in lengths.items()
        if n > SQL_OVER_LIMIT.get(name, (MAX_SQL_LINES, ""))[0]
    }
    assert not over, f"SQL functions over {MAX_SQL_LINES} lines (or past their figure): {over}"
    stale = {
        name: lengths.get(name)
        for name, (figure, _) in SQL_OVER_LIMIT.items()
        if lengths.get(name, 0) < figure
    }
    assert not stale, f"shorter than their figure in SQL_OVER_LIMIT (lower it): {stale}"


#: The functions that processes of the previous release (0.1.0, schema version 8) call, read
#: from its source: they stay while that release is supported (one release after it is
#: superseded, docs/design.md "Schema management").
PREVIOUS_RELEASE_CALLS = frozenset(
    [
        "channel_get_v2",
        "channel_list_v2",
        "channel_policy_clear_v1",
        "channel_policy_set_v2",
        "dead_purge_v1",
        "exchange_declare_v1",
        "exchange_delete_v1",
        "expire_v1",
        "horizon_v1",
        "housekeep_v1",
        "message_create_many_v1",
        "message_create_v1",
        "message_defer_v1",
        "message_delete_many_v1",
        "message_delete_v1",
        "message_dequeue_v3",
        "message_get_v1",
        "message_heartbeat_v1",
        "message_list_v1",
        "message_publish_v1",
        "message_reject_v1",
        "message_remove_v1",
        "message_retry_v1",
        "message_update_v1",
        "queue_bind_v1",
        "queue_configure_v1",
        "queue_declare_v1",
        "queue_delete_v1",
        "queue_policy_set_v2",
        "queue_purge_v1",
        "queue_stats_v1",
        "queue_status_v1",
        "queue_touch_v1",
        "queue_unbind_v1",
        "rate_held_v1",
    ]
)


def python_sql_calls() -> set[str]:
    """The schema functions that the package's Python names: ``{schema}.name_vN(`` in a query,
    or ``sql.Identifier(schema, "name_vN")``."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names.update(SQL_CALL.findall(text))
        names.update(re.findall(r"Identifier\([^()]*?,\s*\"(\w+)\"\)", text))
    return {name for name in names if re.search(r"_v\d+$", name)}  # (not a table's columns)


def test_every_schema_function_has_a_caller() -> None:
    from lonnymq.roles import FUNCTIONS

    functions = sql_functions()
    granted = {name for names in FUNCTIONS.values() for name in names}
    python = python_sql_calls()
    assert {"message_dequeue_v3", "expire_v1"} <= python, sorted(python)
    called_by_sql = {
        callee
        for name, lines in functions.items()
        for callee in SQL_CALL.findall("\n".join(lines[1:]))
        if callee != name
    }
    unused = sorted(set(functions) - python - granted - called_by_sql)
    assert not unused, f"schema functions that nothing calls (drop them by a migration): {unused}"
    assert python <= set(functions), sorted(python - set(functions))
    assert granted <= set(functions), sorted(granted - set(functions))
    missing = sorted(PREVIOUS_RELEASE_CALLS - set(functions))
    assert not missing, f"functions the previous release calls are gone: {missing}"


def main() -> int:
    """Print the graph (module -> the package's modules it imports) and the line counts."""
    graph = import_graph()
    counts = line_counts()
    marks = {"module": "", "typing": " (TYPE_CHECKING)", "function": " (in a function)"}
    for module, edges in graph.items():
        size = f"{counts[module]} lines" if module in counts else "not counted"
        print(f"{module}  [{size}]")
        for edge in edges:
            print(f"    -> {edge.target}{marks[edge.where]}")
    found = cycles(graph)
    print()
    groups = "; ".join(", ".join(component) for component in found)
    print(f"modules in an import cycle: {groups or 'none'}")
    over = ", ".join(f"{m} ({n})" for m, n in counts.items() if n > MAX_LINES)
    print(f"modules over {MAX_LINES} lines: {over or 'none'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
