"""The library's layers hold: no import cycle, no import that runs up a layer, and no
function-local import of the package except the few named below, each with its reason.

Why an AST test rather than ``import-linter``: the rule that matters most here is the one
import-linter cannot see, imports inside functions (they are how a circle hides: the module
graph looks clean while every call closes the loop). Thirty lines of :mod:`ast` count them
too, need no extra dependency, and run with the unit tests in well under a second.

The layers are those of the README's design section, lowest first. A module may import
from its own layer or any below; an upward import is allowed only where it is listed in
:data:`LATE_BOUND` (optional extras, imported lazily so that the core install stays
small, and the CLI's commands). A new module fails this test until it is given a layer,
which is the point: its author decides where it sits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sqla_jobs

from ..helpers import PUBLIC_MODULES

PACKAGE = Path(sqla_jobs.__file__).parent

# Lowest first. Keys are module names below ``sqla_jobs`` ("" is the package itself).
LAYERS: dict[str, int] = {}


def _layer(names: str, level: int) -> None:
    for name in names.split():
        LAYERS[name] = level


# 1. Leaves: the storage contract, errors, schedules, engines. 2. Statements and the
# checks under them. 3. Tasks, their options and the registry. 4. The binder and writer.
# 5. Its adapters (session, Core connection, groups, periodic) and claiming. 6. ``Jobs``,
# whose methods call those adapters. 7. The worker. 8. The package root and the operator
# model. 9. What runs workers and tests (sharding, launch, the pytest plugin). 10. The
# optional extras' faces. 11. The CLI.
_layer("errors _storable cron events db model health _direct", 1)
_layer("_queries _step_queries _bulk throttle _settle", 2)
_layer("_tasks", 3)
_layer("_enqueue", 4)
_layer("session connection flow claiming periodic steps", 5)
_layer("tasks", 6)
_layer(
    "logs worker worker.settings worker._steps worker.job worker._outage worker._signals"
    " worker._supervise worker.supervisor worker._vitals worker._hearing worker._statements"
    " worker._fetch worker._duties worker._duties.completer worker._duties.heartbeat"
    " worker._duties.listener worker._duties.maintenance worker._duties.presence worker._core"
    " worker._driver worker.threaded worker.aio",
    7,
)
_layer("admin _present", 8)
LAYERS[""] = 8  # the package root: it re-exports the core and the worker
_layer("sharding aio worker._launch pytest_plugin testing", 9)
_layer("web web.app web.shards web._base metrics tracing flask", 10)
_layer("cli", 11)

#: The function-local imports that are there on purpose, each with its reason. All of them
#: load an optional extra (or a test tool) that the core install does not have, so that
#: importing the module that names them works without it. Nothing else is imported late.
LATE_BOUND: dict[tuple[str, str], str] = {
    ("cli", "web"): "the dashboard's extra (starlette, jinja2), for `sqla-jobs web` only",
    ("cli", "web._base"): "the same extra: the allowed-hosts check of `sqla-jobs web`",
    ("worker", "worker.aio"): "AsyncWorker needs SQLAlchemy's asyncio extra (greenlet)",
    ("worker._launch", "worker.aio"): "the asyncio worker, only with its extra (greenlet)",
    ("worker._launch", "metrics"): "the metrics endpoint's extra (prometheus-client)",
    ("testing", "pytest_plugin"): "pytest is no dependency: loaded when pytest asks for it",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _short(name: str) -> str:
    return name.removeprefix("sqla_jobs").removeprefix(".")


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement loads, as names below ``sqla_jobs``."""
    if isinstance(node, ast.Import):
        full = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = ["sqla_jobs", *module.split(".")] if module else ["sqla_jobs"]
            if MODULES[module].name != "__init__.py":
                here.pop()
            here = here[: len(here) - node.level + 1]
            base = ".".join([*here, base] if base else here)
        # ``from . import statements`` loads the submodule, not the package's own names;
        # the package (its ``__init__``) counts only when a name is taken from it.
        full = [f"{base}.{alias.name}" for alias in node.names]
        if any(_short(name) not in MODULES for name in full):
            full.append(base)
    found = []
    for name in full:
        if name != "sqla_jobs" and not name.startswith("sqla_jobs."):
            continue
        short = name.removeprefix("sqla_jobs").removeprefix(".")
        while short and short not in MODULES:
            short = short.rpartition(".")[0]
        if short != module:
            found.append(short)
    return found


def _imports() -> list[tuple[str, str, bool]]:
    """Every (importer, imported, inside a function) edge, ``TYPE_CHECKING`` blocks left out."""
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped: set[int] = set()
        local: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in set(_targets(module, node)):
                    edges.append((module, target, id(node) in local))
    return edges


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(MODULES) - set(LAYERS))
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_no_import_cycle_counting_function_local_imports() -> None:
    edges = {(a, b) for a, b, _ in _imports() if (a, b) not in LATE_BOUND}
    assert _cycles(edges) == []


def test_no_import_runs_up_a_layer() -> None:
    upward = sorted(
        (a, b)
        for a, b, _ in _imports()
        if LAYERS.get(b, 0) > LAYERS.get(a, 0) and (a, b) not in LATE_BOUND
    )
    assert upward == []


def test_function_local_imports_are_the_named_ones() -> None:
    """Every function-local import is a named one, and every named one still exists."""
    local = sorted({(a, b) for a, b, inside in _imports() if inside})
    assert local == sorted(LATE_BOUND)


def test_the_checker_sees_a_function_local_cycle(tmp_path: Path) -> None:
    """The checker itself: a circle closed only inside a function is found."""
    assert _cycles({("a", "b"), ("b", "a")}) == [["a", "b"]]
    assert _cycles({("a", "b"), ("b", "c")}) == []


#: The public face: the package root, the modules documented in
#: ``docs/reference/modules.md``, and those whose names ``sqla_jobs`` re-exports and users
#: import directly. Every other module is internal, and says so with a leading underscore.
PUBLIC = {
    "",
    *PUBLIC_MODULES,
    "model",
    "session",
    "tasks",
    "connection",
    "claiming",
    "errors",
    "db",
    "cron",
    "logs",
    "health",
    "worker.settings",
    "worker.job",
    "worker.threaded",
    "worker.aio",
    "worker.supervisor",
}
#: Not marked, and not public either: the console script's module, and the dashboard's
#: two views (reached through ``sqla_jobs.web.create_app``).
UNMARKED = {"cli", "web.app", "web.shards"}


def test_internal_modules_are_marked() -> None:
    unmarked = sorted(
        name
        for name in MODULES
        if name not in PUBLIC | UNMARKED
        and not any(part.startswith("_") for part in name.split("."))
    )
    assert unmarked == []
    assert not {m for m in PUBLIC if any(p.startswith("_") for p in m.split("."))}
    assert set(MODULES) >= PUBLIC
