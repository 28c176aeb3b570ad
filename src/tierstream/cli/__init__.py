"""The ``tierstream`` command line (typer + rich).

Every command that talks to a broker takes ``--broker`` (env ``TIERSTREAM_BROKER``); every
command that opens the store directly takes ``--data-dir`` (env ``TIERSTREAM_HOME``).
Errors are one line on stderr naming the bad value; exit status 2 for bad input (including a
topic that does not exist, or already does), 1 for a broker, storage or environment problem
(an unreachable broker, a port in use, a data directory another broker holds).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from typing import Annotated, Any

import typer

from tierstream.cli import (  # noqa: F401 - registers them
    admin,
    broker,
    cache,
    compaction,
    produce,
    reads,
    schemas,
    spark_jobs,
    stats,
    topics,
)
from tierstream.cli.common import app, err, out
from tierstream.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    TierstreamError,
)
from tierstream.util.signals import exit_process

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Entry point. Every error is one line on stderr and an exit status: 2 for a usage error or
    bad input, 1 for a broker, storage or environment problem, 130 when interrupted. A Python
    traceback appears only with ``--debug`` (anywhere on the command line) or
    ``TIERSTREAM_DEBUG=1``."""
    args = list(sys.argv[1:] if argv is None else argv)
    # a fatal signal (a segfault in a native library, an abort) leaves the Python stack of
    # every thread on stderr, the broker's log, instead of a process that just vanished
    faulthandler.enable(all_threads=True)
    _take_sigint()
    debug = "--debug" in args or os.environ.get("TIERSTREAM_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ["TIERSTREAM_DEBUG"] = "1"  # Spark jobs keep Spark's trace too
        logging.getLogger("tierstream").setLevel(logging.DEBUG)
    try:
        code = app(args=args, prog_name="tierstream", standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except SystemExit as exc:  # typer's own exit: 1 when the reader of stdout left (EPIPE)
        code = 0 if _reader_left() else exc.code
    except (typer.Abort, KeyboardInterrupt):
        err.print("interrupted")
        code = 130
    except BrokenPipeError:  # e.g. `tierstream consume ... | head`: the reader left
        sys.stderr.close()
        code = 0
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors
        _traceback_if(debug)
        code = _usage_error(exc, args)
    except TierstreamError as exc:
        _traceback_if(debug)
        _error_line(str(exc))
        # bad input (2) includes naming a topic that does not exist or already does
        code = 2 if isinstance(exc, (ConfigError, NotFoundError, AlreadyExistsError)) else 1
    except Exception as exc:  # a bug: say so in one line, the traceback is one flag away
        _traceback_if(debug)
        _error_line(f"unexpected {type(exc).__name__}: {exc} (run again with --debug for the "
                    "traceback, and please report it)")
        code = 1
    exit_process(code if isinstance(code, int) else 0)  # a broker may have left a server


def _reader_left() -> bool:
    """Whether stdout's reader went away (``tierstream consume ... | head``): click then
    wraps stdout to silence the broken pipe. Unix tools end quietly there, and so do we."""
    from typer._click.utils import PacifyFlushWrapper

    return isinstance(sys.stdout, PacifyFlushWrapper)


def _traceback_if(debug: bool) -> None:
    """With ``--debug``, the traceback of the error being handled, before its one line: the
    exit status stays what it is without the flag (2 for bad input)."""
    if debug:
        import traceback

        traceback.print_exc()


def _take_sigint() -> None:
    """Ctrl-C stops every command, as it stops ``broker start`` and ``tail`` (which handle it
    themselves). A process whose parent ignored SIGINT (a non-interactive shell's background
    job, a CI runner, some test workers) gets no KeyboardInterrupt from Python: without this,
    ``consume --follow`` and ``topic stats --watch`` would run on after SIGINT."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _error_line(message: str) -> None:
    err.print(f"[red]error:[/red] {' '.join(message.split())}", markup=True, highlight=False)


def _usage_error(exc: Any, args: list[str]) -> int:
    """One line for a usage error, naming the bad value where the parser did not."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "tierstream"
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        text = ctx.get_help()  # a bare group: show what it offers (typer prints it itself)
        if text:
            out.print(text, highlight=False)
        return 2
    message = exc.format_message()
    if type(exc).__name__ == "NoSuchOption":
        import difflib

        close = difflib.get_close_matches(str(exc.option_name), list(exc.possibilities or []), 1)
        message = f"no such option {exc.option_name}" + (
            f"; did you mean {close[0]}?" if close else "")
    param = getattr(exc, "param", None)
    if type(exc).__name__ == "BadParameter" and param is not None:
        given = _given(args, list(getattr(param, "opts", [])))
        if given is not None:
            message = f"{message} (got {given!r})"
    _error_line(f"{message} (see '{command} --help')")
    return int(getattr(exc, "exit_code", 2) or 2)


def _given(args: list[str], opts: list[str]) -> str | None:
    for i, a in enumerate(args):
        for opt in opts:
            if a == opt and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(opt + "="):
                return a[len(opt) + 1:]
    return None


def _version(value: bool) -> None:
    if value:
        from tierstream import __version__

        out.print(f"tierstream {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option(
        "--debug", help="On an error, print its traceback too (allowed anywhere on the "
                        "command line; or TIERSTREAM_DEBUG=1).")] = False,
) -> None:
    """Read a tiered, Pulsar-shaped event log with one source API for batch and stream.

    Errors are one line; add --debug anywhere for a traceback.
    """


def _tidy_help() -> None:
    """The command list: sorted by name, each command with its first sentence on one line
    (typer would show the docstring's first paragraph with its line breaks)."""
    import re

    for info in app.registered_commands:
        doc = (info.callback.__doc__ or "") if info.callback else ""
        first = " ".join(doc.strip().split("\n\n")[0].split())
        info.short_help = info.short_help or re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
    app.registered_commands.sort(key=lambda c: c.name or (c.callback.__name__ if c.callback
                                                          else ""))
    app.registered_groups.sort(key=lambda g: g.name or "")


_tidy_help()
