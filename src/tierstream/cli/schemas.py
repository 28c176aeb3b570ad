"""``tierstream schema set|get|list|check``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierstream.cli.common import BrokerOpt, TlsCaOpt, TokenOpt, err, out, schema_app
from tierstream.errors import ConfigError
from tierstream.options import DEFAULT_BROKER_URL
from tierstream.util.timeutil import format_ms

TypeOpt = Annotated[str, typer.Option(
    "--type", help="none, string, json (a JSON Schema) or avro (an Avro schema).")]
FileOpt = Annotated[Path | None, typer.Option(
    "--file", help="The schema definition (.avsc, .json); none for string and none.")]


def _definition(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read --file {str(path)!r}: {exc.strerror or exc}") from None


@schema_app.command("set")
def schema_set(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    type_: TypeOpt,
    file: FileOpt = None,
    compatibility: Annotated[str | None, typer.Option(
        help="Set the topic's rule first: BACKWARD (default), FORWARD, FULL, their "
             "_TRANSITIVE forms, ALWAYS_COMPATIBLE, ALWAYS_INCOMPATIBLE.")] = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Add a schema version to a topic (refused, naming the field and the rule, if it is not
    compatible; the same schema again is the version it already is).

    Example: tierstream schema set acme/shop/orders --type avro --file order.avsc
    """
    from tierstream.client import Admin

    definition = _definition(file)
    with Admin(broker, auth_token=auth_token) as admin:
        if compatibility is not None:
            admin.set_schema_compatibility(topic, compatibility)
        info = admin.register_schema(topic, type_, definition)
    out.print(f"{info.topic}: schema version {info.version} ({info.type.value}, fingerprint "
              f"{info.fingerprint[:16]})", highlight=False)


@schema_app.command("get")
def schema_get(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    version: Annotated[int | None, typer.Option(help="A version \\[default: the latest].")]
        = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Print a schema version's definition (the latest by default) on stdout, as a file
    `schema set --file` takes (an .avsc for AVRO); its version and fingerprint go to stderr.

    Example: tierstream schema get acme/shop/orders --version 1 > order-v1.avsc
    """
    import json

    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        info = admin.get_schema(topic, version)
    err.print(f"{info.topic} version {info.version} {info.type.value} {info.fingerprint}",
              highlight=False)
    if info.definition is None:
        err.print(f"({info.type.value} has no definition)", highlight=False)
        return
    sys.stdout.write(json.dumps(json.loads(info.definition), indent=2) + "\n")


@schema_app.command("list")
def schema_list(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """List a topic's schema versions and its compatibility rule.

    Example: tierstream schema list acme/shop/orders
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        rule, versions = admin.list_schemas(topic)
    table = Table("version", "type", "fingerprint", "created", title=f"{topic} ({rule})")
    for v in versions:
        table.add_row(str(v.version), v.type.value, v.fingerprint[:16], format_ms(v.created_at))
    out.print(table)
    if not versions:
        out.print("no schema: values are bytes", highlight=False)


@schema_app.command("check")
def schema_check(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    type_: TypeOpt,
    file: FileOpt = None,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Say whether a schema could become the topic's next version (exit status 1 if not).

    Example: tierstream schema check acme/shop/orders --type avro --file order-v2.avsc
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        reason = admin.check_schema(topic, type_, _definition(file))
    if reason is not None:
        out.print(f"incompatible: {reason}", highlight=False)
        raise typer.Exit(1)
    out.print("compatible", highlight=False)
