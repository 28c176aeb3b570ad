"""What every command module shares: the typer apps, the two consoles, the common options
and the small formatting helpers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tierstream.cli import help_panel
from tierstream.cli.bounds import write_cut
from tierstream.errors import ConfigError
from tierstream.util.units import human_bytes

__all__ = ["BrokerOpt", "CutOutOpt", "DataDirOpt", "FromOpt", "KeyRangesOpt", "LossOpt",
           "ModeOpt", "QuietOpt", "ReaderOpt", "SplitBytesOpt", "TierCacheOpt", "TimeFieldOpt",
           "TlsCaOpt", "TlsCertOpt", "TlsKeyOpt", "ToOpt", "TokenOpt", "ValueFormatOpt", "app",
           "bookie_app", "broker_app", "check_output_path", "err", "human_bytes",
           "human_duration", "out", "progress_bar", "report_cut", "say_moved", "schema_app",
           "topic_app", "use_tls_ca"]

def _no_placeholder_on_flags() -> None:
    """typer shows ``<bool>`` beside on/off flags (``--yes <bool>``, ``--help <bool>``), as if
    they took a value: a flag's help shows no type."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign,assignment]


_no_placeholder_on_flags()
help_panel.install()

app = typer.Typer(
    name="tierstream",
    help="Read a tiered, Pulsar-shaped event log with one source API for batch and stream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
broker_app = typer.Typer(help="Run the embedded broker.", no_args_is_help=True)
topic_app = typer.Typer(help="Create, list, change and delete topics.", no_args_is_help=True)
bookie_app = typer.Typer(help="Serve a bookie: its ledgers to readers on other hosts, and "
                              "with --metadata, writes from brokers (a network bookie).",
                         no_args_is_help=True)
schema_app = typer.Typer(help="Topic schemas: versions, compatibility, checks.",
                         no_args_is_help=True)
app.add_typer(broker_app, name="broker")
app.add_typer(schema_app, name="schema")
app.add_typer(bookie_app, name="bookie")
app.add_typer(topic_app, name="topic")


class _Lines(Console):
    """stdout: as wide as COLUMNS says, read as each command prints (not when this module was
    imported), else on a terminal as wide as it is and piped 160 columns (rich would squeeze
    tables to 80). Its lines end at their last character: rich pads every
    table cell to its column, so a table without borders left blanks at the end of most lines
    (14 of ``broker stats``'s, piped into a file)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit() and int(columns) > 0:
            return ConsoleDimensions(int(columns), size.height)
        return size if self.is_terminal else ConsoleDimensions(160, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def _render_buffer(self, buffer: Any) -> str:
        return "\n".join(line.rstrip(" ") for line in super()._render_buffer(buffer).split("\n"))


out = _Lines(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

BrokerOpt = Annotated[str, typer.Option(
    "--broker", envvar="TIERSTREAM_BROKER",
    help="Broker URL, grpc://HOST:PORT (grpc+tls:// with TLS); several, comma-separated, are "
         "tried in turn until one answers.", show_default=True)]
DataDirOpt = Annotated[Path, typer.Option(
    "--data-dir", envvar="TIERSTREAM_HOME", help="Data directory of the embedded store.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--auth-token", envvar="TIERSTREAM_AUTH_TOKEN", show_envvar=True,
    help="Bearer token (required when a broker or bookie binds a non-loopback address).")]

TlsCertOpt = Annotated[str | None, typer.Option(
    "--tls-cert", help="PEM certificate: serve grpc+tls:// (with --tls-key).")]
TlsKeyOpt = Annotated[str | None, typer.Option("--tls-key", help="PEM private key of --tls-cert.")]
def _tls_ca(value: str | None) -> str | None:
    """--tls-ca's callback: checked when the command line is parsed (use_tls_ca)."""
    use_tls_ca(value or None)
    return value


TlsCaOpt = Annotated[str | None, typer.Option(
    "--tls-ca", envvar="TIERSTREAM_TLS_CA", show_envvar=True, callback=_tls_ca,
    help="PEM CA that grpc+tls:// endpoints are checked against (default: the system's).")]


def _tier_cache_size(value: str | None) -> str | None:
    """--tier-cache-size's callback: checked, then the size of this process's tier cache and
    its Spark workers' (they inherit the environment)."""
    if value:
        from tierstream.tier.host_cache import SIZE_ENV, parse_cache_size

        parse_cache_size(value, "--tier-cache-size")
        os.environ[SIZE_ENV] = value
    return value


TierCacheOpt = Annotated[str | None, typer.Option(
    "--tier-cache-size", envvar="TIERSTREAM_TIER_CACHE_SIZE", show_envvar=True,
    callback=_tier_cache_size,
    help="The most bytes this host's cache of tier files read from object storage holds, "
         "such as 2GiB; 0 turns it off (default: a tenth of the free disk, at most 20GiB; "
         "see tierstream cache).")]


QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar (there is none when stderr is not a terminal).")]


def progress_bar(show: bool) -> Progress:
    """A bar on stderr, drawn only when ``show`` and stderr is a terminal. What the command
    writes to stdout meanwhile stays on stdout (rich would otherwise print it above the bar,
    on stderr)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=err, disable=not show or not err.is_terminal,
                    transient=True, redirect_stdout=False, redirect_stderr=False)


def human_duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.1f}{unit}"
    return f"{ms}ms"


# -- what the reading commands share (reads.py, spark_jobs.py) ---------------------------

FromOpt = Annotated[str, typer.Option("--from", help="earliest, latest, ISO-8601, epoch ms, "
                                                     "p:s:e or a stream cut (JSON or @FILE).")]
ToOpt = Annotated[str, typer.Option("--to", help="Exclusive end: latest (at planning), a time, "
                                                 "a position or a stream cut.")]
CutOutOpt = Annotated[Path | None, typer.Option(
    "--cut-out", help="Also write the end cut to this file (for a later --from @FILE).")]
KeyRangesOpt = Annotated[int, typer.Option(help="Split every partition into K key ranges.")]
ValueFormatOpt = Annotated[str, typer.Option(
    "--value-format", help="raw (bytes) or auto (decoded by the topic's schema).")]
ModeOpt = Annotated[str, typer.Option(
    "--mode", help="--value-format auto: FAILFAST, PERMISSIVE (_corrupt_record) or "
                   "DROPMALFORMED.")]
SplitBytesOpt = Annotated[str | None, typer.Option(help="Target split size, e.g. 64MiB.")]
ReaderOpt = Annotated[str | None, typer.Option(help="Force a reader: parquet-tier, bookie-log "
                                                    "or tail-consumer.")]
TimeFieldOpt = Annotated[str, typer.Option(
    "--time-field", help="What --from/--to times mean: publish_time (found by a binary search "
                         "over segments) or event_time (a filter over the whole log up to "
                         "its latest message: event times are in no order).")]
LossOpt = Annotated[bool, typer.Option("--fail-on-data-loss/--skip-data-loss",
                                       help="Fail (default) or skip when data is gone.")]


def use_tls_ca(tls_ca: str | None) -> bytes | None:
    """The CA of --tls-ca (ConfigError naming the flag if it cannot be read); also made the
    default of every client this command opens (the option table reads TIERSTREAM_TLS_CA)."""
    import os

    from tierstream.wire.security import read_pem

    if tls_ca is None:
        return None
    pem = read_pem(tls_ca, "--tls-ca")
    os.environ["TIERSTREAM_TLS_CA"] = tls_ca
    return pem


def say_moved(moved: dict[str, str]) -> None:
    """What ``topic unload`` and ``broker drain`` moved: each partition and its new owner."""
    out.print(f"moved {len(moved)} partition(s): " + (", ".join(
        f"{k} to {v}" for k, v in sorted(moved.items())) or "none"), highlight=False)


def report_cut(cut: Any, cut_out: Path | None) -> None:
    """Print the end cut (and write it to ``cut_out``): where a next read starts."""
    if cut is None:
        return
    if cut_out is not None:
        write_cut(cut, cut_out)
        err.print(f"end cut written to {cut_out} (continue with --from @{cut_out})",
                  highlight=False)
    err.print(f"end cut: {cut.to_json()}", highlight=False, soft_wrap=True)


def check_output_path(path: str | Path | None, flag: str) -> None:
    """Before any work: ``path`` can be written (its directory exists, is a directory and
    takes a new file; ``path`` is not a directory), so a command never fails on its last
    output after writing the others (ConfigError naming ``flag`` and the path)."""
    if path is None:
        return
    target = Path(path)
    shown = str(path)
    if target.is_dir() and flag == "--cut-out":
        raise ConfigError(f"{flag} {shown!r} is a directory; give a file path")
    parent = target.parent
    if not parent.exists():
        raise ConfigError(f"{flag} {shown!r}: directory {str(parent)!r} does not exist "
                          "(nothing was written)")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {shown!r}: {str(parent)!r} is a file, not a directory "
                          "(nothing was written)")
    probe = parent / f".{target.name}.{os.getpid()}.probe"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {shown!r}: cannot write in {str(parent)!r}: "
                          f"{exc.strerror or exc} (nothing was written)") from None

