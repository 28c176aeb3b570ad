"""Every command's help as a user reads it in an 80-column terminal."""

from __future__ import annotations

import re
import sys

import pytest
import typer

from tierstream.cli import app

from .every_help import commands
from .terminal import in_terminal


def _sections(text: str) -> dict[str, str]:
    shown: dict[str, str] = {}
    for part in text.split("===== ")[1:]:
        name, _, body = part.partition("\n")
        shown[name.strip()] = body
    return shown


@pytest.fixture(scope="module")
def shown() -> dict[str, str]:
    """Every command's help as printed in an 80-column terminal, by command (one process)."""
    code, text = in_terminal([sys.executable, "-m", "tests.cli.every_help"], {}, columns=80)
    assert code == 0, text
    return _sections(text)


def test_every_command_has_help_with_an_example(shown: dict[str, str]) -> None:
    every = [" ".join(path) for path, _ in commands(typer.main.get_command(app), [])]
    assert len(every) > 20, every
    lacking = [name for name in every if "Example: tierstream" not in shown[name]]
    assert not lacking, lacking


def test_every_flag_name_reads_whole_in_an_80_column_terminal(shown: dict[str, str]) -> None:
    """Regression: at 80 columns typer's table cut nine of ``broker start``'s flag names
    (``--segment-rollover-…``, ``--no-allow-auto-top…``) and one still at 100, and the
    paragraphs after a command's first one broke where the docstring's lines did
    (``(--skip-data-loss:`` / ``print what`` / ``survives ...``)."""
    every = list(commands(typer.main.get_command(app), []))
    assert len(shown) == len(every) + 1 and len(every) > 20, sorted(shown)
    for path, command in every:
        help_text = shown[" ".join(path)]
        assert "…" not in help_text, help_text
        assert all(len(line) <= 80 for line in help_text.splitlines()), help_text
        for param in command.params:
            for name in [*param.opts, *getattr(param, "secondary_opts", [])]:
                if name.startswith("--"):
                    assert name in re.findall(r"--[\w-]+", help_text), (path, name, help_text)
    assert "(--skip-data-loss:\n" not in shown["consume"]
    assert "print what survives" in shown["consume"], shown["consume"]


def test_a_group_lists_its_commands_in_flowing_sentences() -> None:
    """Regression: a group's list kept the docstring's line breaks (``... if it is not`` /
    ``compatible; ...``), a short line in the middle of a sentence."""
    code, text = in_terminal([sys.executable, "-m", "tierstream", "schema", "--help"], {},
                             columns=80)
    assert code == 0 and "rule, if it is not compatible; the same schema again is the " \
        "version" in text, text


def test_no_url_in_help_is_broken_mid_word(shown: dict[str, str]) -> None:
    """Regression: at 80 columns ``postgresql+psycopg://user@host/datab`` / ``ase`` and
    ``postgresql://user[:password]@host[:p`` / ``ort]/db``: every URL shown is whole."""
    for name, text in shown.items():
        for url in re.findall(r"[a-z+]+://\S*", text):
            assert not url.endswith(("│", "/datab", "[:p")), (name, url)
    assert "postgresql+psycopg://user@host/db)." in shown["broker start"]
    assert "postgresql://user@host:port/db" in shown["broker start"]
