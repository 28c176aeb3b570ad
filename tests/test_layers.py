"""Which package may import which: the layers of the source tree as a table, checked at
package granularity on every import — at module level, inside functions and for type
checking alike (``test_layout.py`` reads them). A package imports only what its row names,
and the table itself has no circle, so every dependency points down."""

from __future__ import annotations

from .test_layout import SRC, _imports, _modules

#: the root's modules are entries of their own (``(root).options``); ``tierstream`` is the
#: package's ``__init__`` (the public API)
ERRORS = "(root).errors"
LOW = {ERRORS}
ALLOWED: dict[str, set[str]] = {
    ERRORS: set(),
    # what every layer may use, knowing none of them
    "util": LOW,
    "wire": LOW | {"util"},  # tierstream's Flight wire: no handler, no service
    "schemas": LOW,
    "model": LOW | {"util"},
    "splits": LOW | {"model", "util"},
    # Pulsar's wire: frames, commands, ids, metadata; never the broker's handlers
    "pulsar_protocol": LOW | {"model", "schemas", "splits"},
    "(root).options": LOW | {"model", "util"},
    "metadata": LOW | {"model", "schemas", "splits", "util"},
    "tier": LOW | {"model", "splits", "util"},
    # a user's process: never the server's packages (broker, managed ledger, bookie, tier)
    "client": LOW | {"(root).options", "metadata", "model", "schemas", "splits", "util",
                     "wire"},
    # the bookie server: never the broker or its client of bookies (it registers itself
    # through the client library, as any tool would)
    "bookie": LOW | {"client", "metadata", "model", "splits", "util", "wire"},
    "managed_ledger": LOW | {"bookie", "metadata", "model", "splits", "tier", "util", "wire"},
    # the source framework: plans, readers, runtime, Spark — never the broker
    "enumerator": LOW | {"client", "metadata", "model", "schemas", "splits", "util"},
    "readers": LOW | {"bookie", "client", "model", "splits", "tier", "util", "wire"},
    "(root).read_options": LOW | {"(root).options", "enumerator", "model", "schemas",
                                  "splits", "wire"},
    "runtime": LOW | {"(root).read_options", "client", "model", "readers", "schemas",
                      "splits", "util"},
    "spark_adapter": LOW | {"(root).options", "(root).read_options", "client", "enumerator",
                            "model", "readers", "schemas", "splits", "tier", "util", "wire"},
    "tierstream": LOW | {"(root).read_options", "model", "runtime", "splits", "util"},
    # the broker runs everything below it, the CLI runs everything
    "broker": LOW | {"(root).options", "bookie", "managed_ledger", "metadata", "model",
                     "pulsar_protocol", "schemas", "splits", "tier", "util", "wire"},
    "(root).demo": LOW | {"broker", "client", "model", "spark_adapter", "splits", "tierstream",
                          "util"},
    "cli": LOW | {"(root).demo", "(root).options", "(root).read_options", "bookie", "broker",
                  "client", "metadata", "model", "readers", "runtime", "schemas",
                  "spark_adapter", "splits", "tier", "tierstream", "util", "wire"},
    "(root).__main__": {"cli"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "tierstream"
    return parts[1] if (SRC / parts[1]).is_dir() else f"(root).{parts[1]}"


def test_every_import_points_down_the_table() -> None:
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        here = _package(name)
        assert here in ALLOWED, f"{here} (of {name}) has no row in the table: add one"
        for imported in sorted(_imports(path, modules)):
            there = _package(imported)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{name} imports {imported} ({here} -> {there})")
    assert wrong == [], "imports the layer table does not allow:\n" + "\n".join(wrong)


def test_the_table_has_no_circle() -> None:
    done: set[str] = set()

    def down(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"a circle in the table: {' -> '.join((*path, package))}"
        if package in done:
            return
        for below in sorted(ALLOWED[package]):
            down(below, (*path, package))
        done.add(package)

    for package in sorted(ALLOWED):
        down(package, ())


def test_the_root_holds_only_entries() -> None:
    """At most ~8 modules at the root, each a user-facing entry."""
    root = sorted(p.stem for p in SRC.glob("*.py"))
    assert root == ["__init__", "__main__", "demo", "errors", "options", "read_options"], root


#: broker/'s own layers: its concerns (subpackages) and the modules at its root, as
#: ``broker/__init__.py`` describes them. The serving surfaces (``flight``, ``pulsar``) import
#: what is below them and never each other; only ``run`` (which starts them) imports them.
SURFACES = {"flight", "pulsar"}
BROKER: dict[str, set[str]] = {
    "(root).__init__": set(),
    "(root).config": set(),
    "(root).data_dir": set(),
    "(root).peers": set(),
    "(root).process": set(),
    "transactions": {"(root).peers"},
    "topics": {"(root).config", "transactions"},
    "cluster": {"(root).config", "(root).peers", "topics", "transactions"},
    "(root).store": {"(root).config", "(root).data_dir", "cluster", "topics", "transactions"},
    "subscriptions": {"(root).store"},
    "stats": {"(root).peers", "(root).store", "cluster", "subscriptions", "topics"},
    "(root).admin_actions": {"(root).store", "cluster", "stats", "subscriptions", "topics"},
    "flight": {"(root).admin_actions", "(root).store", "stats", "subscriptions", "topics"},
    "pulsar": {"(root).admin_actions", "(root).store", "stats", "subscriptions", "topics"},
    "(root).run": {"(root).config", "(root).store", "flight", "pulsar", "stats"},
}


def _concern(module: str) -> str | None:
    """The broker concern of ``module`` (``tierstream.broker.cluster.lease_watch``:
    ``cluster``), or None outside broker/."""
    parts = module.split(".")
    if parts[:2] != ["tierstream", "broker"]:
        return None
    if len(parts) == 2:
        return "(root).__init__"
    return parts[2] if (SRC / "broker" / parts[2]).is_dir() else f"(root).{parts[2]}"


def test_broker_concerns_import_down_their_table_and_the_surfaces_never_each_other() -> None:
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        here = _concern(name)
        if here is None:
            continue
        assert here in BROKER, f"broker/{here} (of {name}) has no row in the table: add one"
        for imported in sorted(_imports(path, modules)):
            there = _concern(imported)
            if there is not None and there != here and there not in BROKER[here]:
                wrong.append(f"{name} imports {imported} ({here} -> {there})")
    assert wrong == [], "imports broker/'s table does not allow:\n" + "\n".join(wrong)
    importers = {c for c, below in BROKER.items() if below & SURFACES}
    assert importers == {"(root).run"}, importers
    assert not BROKER["flight"] & SURFACES and not BROKER["pulsar"] & SURFACES


def test_broker_concerns_have_no_circle_and_its_root_few_modules() -> None:
    done: set[str] = set()

    def down(concern: str, path: tuple[str, ...]) -> None:
        assert concern not in path, f"a circle in broker/: {' -> '.join((*path, concern))}"
        if concern not in done:
            for below in sorted(BROKER[concern]):
                down(below, (*path, concern))
            done.add(concern)

    for concern in sorted(BROKER):
        down(concern, ())
    root = sorted(p.stem for p in (SRC / "broker").glob("*.py"))
    assert len(root) <= 10, root
    for package in (p for p in (SRC / "broker").iterdir() if (p / "__init__.py").exists()):
        doc = (package / "__init__.py").read_text()
        assert '"""' in doc and "import" in doc, f"broker/{package.name}: say what it owns " \
                                                 "and what it may import"


def test_the_broker_asks_objects_rather_than_switching_on_their_class() -> None:
    """No ``isinstance(x, SomeConcreteClassOfOurs)`` choosing behaviour in broker/ (a remote
    bookie's epoch, a PostgreSQL backend's session names were chosen so): the object's
    protocol says what it does. Errors (``except``-like checks) and builtins are fine."""
    import ast

    wrong = []
    for path in sorted((SRC / "broker").rglob("*.py")):
        tree = ast.parse(path.read_text())
        ours = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "tierstream") for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) \
                    else [node.args[1]]
                for kind in kinds:
                    name = getattr(kind, "id", None)
                    if name in ours and not name.endswith(("Error", "Name")):
                        wrong.append(f"{path.relative_to(SRC)}:{node.lineno} isinstance "
                                     f"of {name}")
    assert wrong == [], "\n".join(wrong)
