"""Run every tierstream command with one wrong value in each of its options, one after
another in this process, and print one JSON line per case: ``python -m tests.cli.every_input
BROKER_URL WORKDIR``. The cases come from the commands' signatures (typer's), so an option is
covered the day it is added. Each case runs in an empty directory of its own under WORKDIR,
with empty stdin, and is stopped after :data:`LIMIT_S` seconds (a wrong value that starts
something endless is a failure too)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from tierstream.cli import app, main

from .every_help import commands

#: wrong values every option gets: negative, out of any range, and malformed text
WRONG = ("-1", "99999999999999999999", "bogus/../value")
#: commands that serve until stopped or run Spark when their input is right: their checks
#: have tests of their own (test_checked_first.py)
SKIPPED = {"broker start", "bookie serve", "demo"}
#: the arguments a command needs besides the option under test; ``{topic}``: a topic that
#: exists (tail and backfill name one that does not: they stop there, before Spark)
NEEDS = {"read": ["{topic}", "--out", "out.parquet"],
         "backfill": ["acme/guard/none", "--out", "outdir"],
         "tail": ["acme/guard/none", "--out", "outdir", "--checkpoint", "ck"],
         "schema set": ["{topic}", "--type", "json"],
         "schema check": ["{topic}", "--type", "json"]}
TOPIC = "acme/guard/t"
LIMIT_S = 20


class _TooLong(BaseException):
    """A case ran past its limit (not an Exception: the CLI does not catch it)."""


def cases() -> Iterator[tuple[str, list[str]]]:
    """(command, argv) for each option of each command and each wrong value."""
    for path, command in commands(typer.main.get_command(app), []):
        name = " ".join(path)
        if name in SKIPPED:
            continue
        needs = [a.format(topic=TOPIC) for a in NEEDS.get(name, ["{topic}"] if any(
            p.required and not p.opts[0].startswith("-") for p in command.params) else [])]
        for param in command.params:
            flag = param.opts[0] if param.opts else ""
            if not flag.startswith("--") or getattr(param, "is_flag", False) \
                    or flag in ("--help", "--broker"):
                continue
            for value in WRONG:
                rest = list(needs)
                if flag in rest:  # the option under test replaces the needed one
                    i = rest.index(flag)
                    del rest[i:i + 2]
                yield name, [*path, *rest, flag, value]


def run_case(argv: list[str], where: Path, saved: tuple[int, int]) -> dict[str, Any]:
    """One command in ``where``, its stdout and stderr (file descriptors 1 and 2, as a
    process has them) into files beside it."""
    where.mkdir(parents=True)
    code: Any = 0
    os.chdir(where)
    out_file, err_file = where.parent / f"{where.name}.out", where.parent / f"{where.name}.err"
    with open(out_file, "wb") as out, open(err_file, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.stdin = io.StringIO("")
    signal.alarm(LIMIT_S)
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    except _TooLong:
        code = "too long"
    finally:
        signal.alarm(0)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    return {"argv": argv, "code": code, "stderr": err_file.read_text(errors="replace"),
            "left": sorted(p.name for p in where.iterdir())}


def main_() -> None:
    broker, workdir = sys.argv[1], Path(sys.argv[2])
    os.environ["TIERSTREAM_BROKER"] = broker

    def too_long(*_: object) -> None:
        raise _TooLong

    signal.signal(signal.SIGALRM, too_long)
    saved = (os.dup(1), os.dup(2))
    report = os.fdopen(os.dup(1), "w")
    for i, (_, argv) in enumerate(cases()):
        result = run_case(argv, workdir / f"case-{i}", saved)
        report.write(json.dumps(result) + "\n")
        report.flush()


if __name__ == "__main__":
    main_()
