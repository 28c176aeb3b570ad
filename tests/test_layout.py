"""The house rules of the source tree, checked: the layout shows what runs where, one name
per thing, no import circles, and modules small enough to be one idea each."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tierstream"
#: a module past this is usually two ideas (STYLE.md)
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The tierstream modules ``path`` imports, anywhere (an import only for type checking
    is a dependency as well: a circle it closes is a circle)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif node.module in modules:
                    found.add(node.module)
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert cycles == [], f"import circles: {cycles}"


def test_no_module_is_two_ideas_long() -> None:
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_one_name_per_thing_no_plural_twins() -> None:
    twins = []
    for package in [SRC, *[p for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        names = {p.stem for p in package.glob("*.py")} | {
            p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        twins += [f"{package.name}/{n}" for n in names if n + "s" in names]
    assert twins == [], f"modules whose names differ only by a plural: {twins}"


def test_the_tree_shows_what_runs_where() -> None:
    """A user's process imports ``client``; the broker's side is split by component."""
    for package in ("client", "broker", "managed_ledger", "bookie", "metadata", "tier"):
        assert (SRC / package / "__init__.py").is_file(), package
    assert not (SRC / "store").exists()
    # the subscription machinery is one room of the broker, which the protocols plug into
    for part in ("registry", "dispatcher", "attached", "selectors", "key_holds", "cursor_state",
                 "cursor_writer", "dead_letters", "ack_doubt"):
        assert (SRC / "broker" / "subscriptions" / f"{part}.py").is_file(), part
        assert not (SRC / "broker" / f"{part}.py").exists(), part
    modules = _modules()
    server_side = ("tierstream.broker", "tierstream.managed_ledger", "tierstream.bookie.storage",
                   "tierstream.metadata.store", "tierstream.broker.topics.offload")
    for name, path in modules.items():
        if name.startswith("tierstream.client"):
            leaks = sorted(m for m in _imports(path, modules) if m.startswith(server_side))
            assert leaks == [], f"{name} (client side) imports the server side: {leaks}"


def test_the_pulsar_wire_knows_nothing_of_the_broker() -> None:
    """Pulsar's protocol is two layers: the wire (``pulsar_protocol``: frames, commands,
    message ids, message metadata, names, error codes) and the broker's handlers that call
    its services (``broker.pulsar``: listener, connection, produce, consume, admin REST).
    The wire imports no service; only the broker's entry point (``broker.run``) and the
    handlers themselves import the handlers."""
    modules = _modules()
    services = ("tierstream.broker", "tierstream.bookie", "tierstream.metadata",
                "tierstream.client", "tierstream.cli", "tierstream.spark_adapter",
                "tierstream.tier", "tierstream.readers")
    for name, path in modules.items():
        imported = _imports(path, modules)
        if name.startswith("tierstream.pulsar_protocol"):
            upward = sorted(m for m in imported if m.startswith(services))
            assert not upward, f"{name} (the wire) imports {upward}"
        if not name.startswith(("tierstream.broker.pulsar", "tierstream.broker.run")):
            handlers = sorted(m for m in imported if m.startswith("tierstream.broker.pulsar"))
            assert not handlers, f"{name} imports the Pulsar handlers {handlers}"
