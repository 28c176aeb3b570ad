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
    "tierstream": LOW | {"(root).read_options", "model", "runtime", "splits"},
    # the broker runs everything below it, the CLI runs everything
    "broker": LOW | {"(root).options", "bookie", "managed_ledger", "metadata", "model",
                     "pulsar_protocol", "schemas", "splits", "tier", "tierstream", "util",
                     "wire"},
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
