"""What every command module shares: the typer apps, the two consoles, the common options
and the small formatting helpers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tierstream.units import human_bytes

__all__ = ["BrokerOpt", "DataDirOpt", "TlsCaOpt", "TlsCertOpt", "TlsKeyOpt", "TokenOpt", "app",
           "bookie_app", "broker_app", "err", "human_bytes", "human_duration", "out",
           "progress_bar", "schema_app", "topic_app"]

def _no_placeholder_on_flags() -> None:
    """typer shows ``<bool>`` beside on/off flags (``--yes <bool>``, ``--help <bool>``), as if
    they took a value: a flag's help shows no type."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign,assignment]


_no_placeholder_on_flags()

app = typer.Typer(
    name="tierstream",
    help="Read a tiered, Pulsar-shaped event log with one source API for batch and stream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
broker_app = typer.Typer(help="Run the embedded broker.", no_args_is_help=True)
topic_app = typer.Typer(help="Create, list, change and delete topics.", no_args_is_help=True)
bookie_app = typer.Typer(help="Serve a bookie's ledgers to readers on other hosts.",
                         no_args_is_help=True)
schema_app = typer.Typer(help="Topic schemas: versions, compatibility, checks.",
                         no_args_is_help=True)
app.add_typer(broker_app, name="broker")
app.add_typer(schema_app, name="schema")
app.add_typer(bookie_app, name="bookie")
app.add_typer(topic_app, name="topic")

# Tables stay readable when piped (rich would otherwise squeeze them to 80 columns).
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

BrokerOpt = Annotated[str, typer.Option(
    "--broker", envvar="TIERSTREAM_BROKER", help="Broker URL.", show_default=True)]
DataDirOpt = Annotated[Path, typer.Option(
    "--data-dir", envvar="TIERSTREAM_HOME", help="Data directory of the embedded store.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--auth-token", envvar="TIERSTREAM_AUTH_TOKEN", show_envvar=True,
    help="Bearer token (required when the broker binds a non-loopback address).")]

TlsCertOpt = Annotated[str | None, typer.Option(
    "--tls-cert", help="PEM certificate: serve grpc+tls:// (with --tls-key).")]
TlsKeyOpt = Annotated[str | None, typer.Option("--tls-key", help="PEM private key of --tls-cert.")]
def _tls_ca(value: str | None) -> str | None:
    """--tls-ca: checked once, then the default of every client the command opens (the
    option table reads TIERSTREAM_TLS_CA)."""
    if value:
        import os

        from tierstream.store.security import read_pem

        read_pem(value, "--tls-ca")
        os.environ["TIERSTREAM_TLS_CA"] = value
    return value


TlsCaOpt = Annotated[str | None, typer.Option(
    "--tls-ca", envvar="TIERSTREAM_TLS_CA", show_envvar=True, callback=_tls_ca,
    help="PEM CA that grpc+tls:// endpoints are checked against (default: the system's).")]


def progress_bar(show: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=err, disable=not show or not err.is_terminal,
                    transient=True)


def human_duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.1f}{unit}"
    return f"{ms}ms"

