"""The layers of qflow, as docs/architecture.md draws them: which package may
import which. Read from the source (every import, at any depth, except those
under ``if TYPE_CHECKING:``), so a rule broken anywhere fails here.

    protocol      sans-I/O wire protocol: imports nothing else of qflow, no trio
    broker        the model: protocol only, no trio, no I/O
    client        trio client: protocol only
    management    HTTP API and metrics: protocol and broker
    store         the durable store (data directory, configuration, journal): protocol and
                  broker; synchronous file I/O, no trio
    server        trio network side and qflowd's composition: protocol, broker, management, store
    testing       harnesses for tests and benchmarks: anything below it
    spark         the Spark data source: the public client API
    cli           the command-line tools: anything

Inside a package the modules' imports run one way too: no two modules of a
package import each other in a circle, and no module imports another's
private (underscore) name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"qflow": ROOT / "qflow", "cli": ROOT / "cli"}

# The compiled extensions (qflow._accounting_native, qflow._transfers_native, qflow._journal_native,
# qflow._amqp_native) belong to no layer.
NATIVE = "native"
ALLOWED = {
    "protocol": {"protocol", NATIVE},
    "transport": {"transport"},  # TLS and read buffers, beneath the wire protocol: imports no qflow
    "auth": {"auth", "protocol"},  # the users file; the mechanisms are the protocol's
    "broker": {"broker", "protocol", NATIVE},
    "client": {"client", "protocol", "transport", NATIVE},
    "management": {"management", "broker", "protocol", "transport", "version"},
    "store": {"store", "broker", "protocol", NATIVE},  # the durable store: no trio (the server runs its syncs)
    "server": {"server", "management", "store", "broker", "protocol", "transport", "auth"},
    "testing": {"testing", "server", "management", "store", "broker", "client", "protocol", "transport", "auth"},
    "spark": {"spark", "api", "client", "protocol"},
    "api": {"api", "version", "client", "broker", "protocol"},  # qflow/__init__.py: the public names
    "cli": {"cli", "api", "version", "server", "management", "store", "broker", "client", "protocol", "transport",
            "auth"},
}
FORBIDDEN_THIRD_PARTY = {"protocol": {"trio", "h11"}, "broker": {"trio", "h11"}, "store": {"trio", "h11"},
                         "transport": {"trio", "h11"}, "auth": {"trio", "h11"}}


def _module_name(path: Path) -> str:
    for top, base in SOURCES.items():
        if base in path.parents:
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(["qflow", *(["cli"] if top == "cli" else []), *parts])
    raise ValueError(path)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] in ("_accounting_native", "_transfers_native", "_journal_native", "_amqp_native"):
        return NATIVE
    if parts[1] == "__version__":
        return "version"
    return parts[1]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str) -> list[str]:
    """Every module named by an import in ``tree`` (``from qflow import x``
    names qflow.x), skipping TYPE_CHECKING blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here.split(".")[: -node.level] if not here.endswith("__init__") else here.split(".")
                base = ".".join([*package, *([base] if base else [])])
            found.extend(f"{base}.{alias.name}" if base == "qflow" else base for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for base in SOURCES.values():
        for path in base.rglob("*.py"):
            module = _module_name(path)
            graph[module] = set(_imports(ast.parse(path.read_text()), module))
    return graph


GRAPH = _graph()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_each_module_imports_only_from_its_own_layer_or_below(module):
    layer = _layer(module)
    wrong = sorted(m for m in GRAPH[module] if m.split(".")[0] == "qflow" and _layer(m) not in ALLOWED[layer])
    assert not wrong, f"{module} ({layer}) may import only {sorted(ALLOWED[layer])}, but imports {wrong}"
    banned = FORBIDDEN_THIRD_PARTY.get(layer, set())
    wrong = sorted(m for m in GRAPH[module] if m.split(".")[0] in banned)
    assert not wrong, f"{module} ({layer}) must not import {wrong}"


# The broker tells sessions things through their session output and never
# writes a frame itself, so a second wire protocol needs no broker change.
# (It does read and write stored entries, qflow.protocol.entries: that is the
# broker's storage format, whichever protocol a message came in by.)
WIRE_WRITERS = {"qflow.protocol.framing", "qflow.protocol.encodings"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m) == "broker"))
def test_the_broker_writes_no_frames(module):
    wrong = sorted(m for m in GRAPH[module] if m in WIRE_WRITERS)
    assert not wrong, f"{module} imports {wrong}: tell the session output instead (qflow.protocol.session_output)"


def test_no_module_of_qflow_is_in_an_import_cycle():
    internal = {m: {i for i in imports if i in GRAPH} for m, imports in GRAPH.items()}
    # A package's __init__ re-exports its modules: an arrow into the package is an arrow to them.
    cycle = _find_cycle(internal)
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


# -- inside a package -------------------------------------------------------------------------------------------

class Import(NamedTuple):
    """One name an import statement binds: ``module`` is the module it names
    (``from p import m`` names p.m when m is a module), ``name`` the name
    taken from it (None for a module), ``type_only`` whether it is under
    ``if TYPE_CHECKING:``."""

    module: str
    name: str | None
    type_only: bool
    line: int


def _paths() -> dict[str, Path]:
    return {_module_name(path): path for base in SOURCES.values() for path in base.rglob("*.py")}


PATHS = _paths()
NATIVE_MODULES = {"qflow._accounting_native", "qflow._transfers_native", "qflow._journal_native", "qflow._amqp_native"}


def _is_module(name: str) -> bool:
    return name in PATHS or name in NATIVE_MODULES


def _import_statements(tree: ast.AST, here: str, is_package: bool) -> list[Import]:
    """Every import in ``tree`` (at any depth), ``from`` imports resolved to
    the module they name; those under ``if TYPE_CHECKING:`` marked."""
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, None, type_only, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here.split(".") if is_package else here.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub, None, type_only, node.lineno) if _is_module(sub)
                             else Import(base, alias.name, type_only, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def _package_of(module: str) -> str:
    """The package whose module it is (a package's __init__ is its own)."""
    return module if PATHS[module].name == "__init__.py" else module.rsplit(".", 1)[0]


STATEMENTS = {m: _import_statements(ast.parse(path.read_text()), m, path.name == "__init__.py")
              for m, path in PATHS.items()}
PACKAGES = sorted({_package_of(m) for m in PATHS})


def _package_graph(package: str, type_only_too: bool) -> dict[str, set[str]]:
    """The package's modules (its __init__ among them), each with the modules
    of the same package it imports."""
    members = {m for m in PATHS if _package_of(m) == package}
    return {m: {i.module for i in STATEMENTS[m] if i.module in members and i.module != m
                and (type_only_too or not i.type_only)} for m in members}


def _exempt(exemptions: dict[str, str], package: str) -> list[pytest.param]:
    """``package`` as a test parameter; one still exempt is expected to fail,
    and fails the test once it passes, so that its exemption goes."""
    reason = exemptions.get(package)
    marks = [pytest.mark.xfail(strict=True, reason=f"exempt until fixed, then remove it here: {reason}")] \
        if reason else []
    return pytest.param(package, marks=marks, id=package)


# Packages whose modules import each other in a circle at run time, each with
# why. None today: a package added here must be one being fixed.
RUN_TIME_CYCLES_EXEMPT: dict[str, str] = {}


@pytest.mark.parametrize("package", [_exempt(RUN_TIME_CYCLES_EXEMPT, p) for p in PACKAGES])
def test_no_two_modules_of_a_package_import_each_other_at_run_time(package):
    """A circle of run-time imports inside a package (lazy ones inside
    functions included; ``if TYPE_CHECKING:`` ones not) makes its modules
    one lump: none can be read, loaded or tested without the others."""
    cycle = _find_cycle(_package_graph(package, type_only_too=False))
    assert cycle is None, " -> ".join(cycle or [])


# Packages whose modules still name each other in a circle through type-only
# imports (``if TYPE_CHECKING:``), each with why. The rest import one way: a
# module below knows one above only as a protocol it defines itself.
TYPE_ONLY_CYCLES_EXEMPT: dict[str, str] = {}


@pytest.mark.parametrize("package", [_exempt(TYPE_ONLY_CYCLES_EXEMPT, p) for p in PACKAGES])
def test_the_modules_of_a_package_import_one_way_even_for_types(package):
    cycle = _find_cycle(_package_graph(package, type_only_too=True))
    assert cycle is None, " -> ".join(cycle or [])


# Packages with a module that imports another module's private name, each with why.
PRIVATE_IMPORTS_EXEMPT: dict[str, str] = {}


def _private_imports(package: str) -> list[str]:
    """Each ``from x import _y`` in ``package`` where _y is a name of module
    x, not a module of package x (a private module is imported as a module,
    by the modules its package lets use it)."""
    return [f"{m}:{i.line} imports {i.name} from {i.module}"
            for m in sorted(PATHS) if _package_of(m) == package
            for i in STATEMENTS[m] if i.name is not None and i.name.startswith("_") and not i.name.startswith("__")]


@pytest.mark.parametrize("package", [_exempt(PRIVATE_IMPORTS_EXEMPT, p) for p in PACKAGES])
def test_no_module_imports_another_modules_private_name(package):
    """A name with an underscore is its module's own: another module that
    imports it is tied to what its module may change freely."""
    wrong = _private_imports(package)
    assert not wrong, "; ".join(wrong)


def test_the_package_rules_see_the_imports():
    """The package rules' checker: ``from p import m`` names module p.m, a
    relative import resolves against its package, TYPE_CHECKING imports
    are marked, and a private name is told from a private module."""
    tree = ast.parse("from qflow.client import message\nfrom .session import _Waiter\n"
                     "from qflow import _accounting_native\nif TYPE_CHECKING:\n    from . import sender\n"
                     "def f():\n    import qflow.client.errors\n")
    assert [(i.module, i.name, i.type_only) for i in _import_statements(tree, "qflow.client.receiver", False)] == [
        ("qflow.client.message", None, False), ("qflow.client.session", "_Waiter", False),
        ("qflow._accounting_native", None, False), ("qflow.client.sender", None, True),
        ("qflow.client.errors", None, False)]
    graph = _package_graph("qflow.client", type_only_too=False)
    assert "qflow.client.session" in graph["qflow.client.connection"]
    assert "qflow.client.message" in graph["qflow.client.receiver"]
    assert set(graph) >= {"qflow.client", "qflow.client.connection", "qflow.client.message"}
    assert _package_of("qflow.client") == _package_of("qflow.client.session") == "qflow.client"
    assert _package_of("qflow.cli.qflow_send") == "qflow.cli"
    assert "qflow.broker" in PACKAGES and "qflow.cli" in PACKAGES


def test_the_rules_see_the_imports():
    """The checker itself: it finds lazy imports inside functions and resolves
    ``from qflow import x``, so the rules above cannot pass vacuously."""
    tree = ast.parse("def f():\n    from qflow import testing\n    import trio\nfrom qflow.broker import ops\n")
    assert set(_imports(tree, "qflow.x")) == {"qflow.testing", "trio", "qflow.broker"}
    assert "qflow.broker._native_accounting" in GRAPH["qflow.broker.accounting"]  # imported inside a function
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_protocol_core_loads_without_trio():
    code = ("import sys, qflow.protocol, qflow.protocol.framing, qflow.protocol.commands, qflow.protocol.entries;"
            "print(sorted(m for m in ('trio', 'h11', 'qflow.broker', 'qflow.client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
