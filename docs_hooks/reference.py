"""MkDocs hook: the guide's reference pages, generated from the code at build time so that
they cannot drift from it: every ``tierstream`` command with its options (from the typer
app), and the public Python API (``tierstream`` and ``tierstream.client``) with its
signatures and docstrings."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "reference/python.md", content=python_reference()))
    return files


def _commands(group: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    out = []
    for name, sub in sorted(group.commands.items()):
        if hasattr(sub, "commands"):
            out += _commands(sub, [*path, name])
        else:
            out.append(([*path, name], sub))
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def cli_reference() -> str:
    from tierstream.cli import app

    lines = ["# CLI reference", "",
             "Every command and its options, as `tierstream COMMAND --help` prints them "
             "(generated from the code when the guide is built).", ""]
    for path, command in _commands(typer.main.get_command(app), []):
        lines += [f"## tierstream {' '.join(path)}", "", _cell(command.help or ""), ""]
        params = [p for p in command.params if p.opts and p.opts[0] != "--help"]
        if params:
            lines += ["| argument or option | what | default |", "|---|---|---|"]
            for p in params:
                names = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
                default = "" if p.default is None or p.required or callable(p.default) \
                    else f"`{p.default}`"
                lines.append(f"| {names} | {_cell(getattr(p, 'help', '') or '')} | "
                             f"{default} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def python_reference() -> str:
    import tierstream
    import tierstream.client as client

    lines = ["# Python API reference", "",
             "The public API, from its signatures and docstrings (generated when the guide is "
             "built). Errors are those of `tierstream.errors`.", ""]
    for module in (tierstream, client):
        lines += [f"## `{module.__name__}`", ""]
        for name in sorted(module.__all__):
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or name.startswith("_"):
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = ""
            lines += [f"### `{name}`", "", "```python", f"{name}{signature}", "```", "",
                      inspect.cleandoc(obj.__doc__ or ""), ""]
            if inspect.isclass(obj) and module is client:
                for meth, fn in sorted(vars(obj).items()):
                    if meth.startswith("_") or not inspect.isfunction(fn):
                        continue
                    lines += [f"#### `{name}.{meth}`", "", "```python",
                              f"{meth}{inspect.signature(fn)}", "```", "",
                              inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(lines) + "\n"
