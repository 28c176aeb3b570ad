"""Print the help of every tierstream command, one after another, each headed by a line
``===== <command>``: ``python -m tests.cli.every_help``. The tests run it in a terminal of
a given width (one process for all commands, not one per command)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer

from tierstream.cli import app


def commands(group: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    """Every command (leaf) under ``group``, with its path of names."""
    for name, sub in group.commands.items():
        if hasattr(sub, "commands"):
            yield from commands(sub, [*path, name])
        else:
            yield [*path, name], sub


def main() -> None:
    for path, _ in [([], None), *commands(typer.main.get_command(app), [])]:
        print("=====", " ".join(path), flush=True)
        app(args=[*path, "--help"], prog_name="tierstream", standalone_mode=False)


if __name__ == "__main__":
    main()
