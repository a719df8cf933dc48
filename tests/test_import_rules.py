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
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"qflow": ROOT / "qflow", "cli": ROOT / "cli"}

# The compiled extensions (qflow._accounting_native, qflow._transfers_native, qflow._journal_native) belong to no layer.
NATIVE = "native"
ALLOWED = {
    "protocol": {"protocol", NATIVE},
    "broker": {"broker", "protocol", NATIVE},
    "client": {"client", "protocol", NATIVE},
    "management": {"management", "broker", "protocol", "version"},
    "store": {"store", "broker", "protocol", NATIVE},  # the durable store: no trio (the server runs its syncs)
    "server": {"server", "management", "store", "broker", "protocol"},
    "testing": {"testing", "server", "management", "store", "broker", "client", "protocol"},
    "spark": {"spark", "api", "client", "protocol"},
    "api": {"api", "version", "client", "broker", "protocol"},  # qflow/__init__.py: the public names
    "cli": {"cli", "api", "version", "server", "management", "store", "broker", "client", "protocol"},
}
FORBIDDEN_THIRD_PARTY = {"protocol": {"trio", "h11"}, "broker": {"trio", "h11"}, "store": {"trio", "h11"}}


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
    if parts[1] in ("_accounting_native", "_transfers_native", "_journal_native"):
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
