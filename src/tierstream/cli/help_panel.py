"""Help laid out for an 80-column terminal.

typer's options table gives an on/off flag's two forms a column each (``--fsync``,
``--no-fsync``) and lets rich cut every column to fit, so at 80 columns nine of
``broker start``'s flag names were cut (``--segment-rollover-…``). Here a flag's name is
never cut: its two forms share one cell, one under the other, and the help text wraps in the
width that is left. The help text itself (with its env var and default) is typer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _names(param: Any) -> Text:
    """``--name, -n`` (or an argument's NAME), with the flag's off form on a second line."""
    from typer import rich_utils

    argument = getattr(param, "param_type_name", "") == "argument"
    on = [param.display_name_raw] if argument else list(param.opts)
    off = list(getattr(param, "secondary_opts", []) or [])
    text = rich_utils.highlighter(", ".join(sorted(on, key=lambda s: not s.startswith("--"))))
    if off:
        text.append("\n")
        text.append_text(rich_utils.negative_highlighter(", ".join(off)))
    return text


def _type(param: Any, ctx: Any) -> Text:
    from typer import rich_utils

    shown = Text(style=rich_utils.STYLE_TYPES, overflow="fold")
    display = param.display_type_rich(ctx=ctx)
    if display is not None:
        shown.append(display)
    bounds = param._get_number_range_help_str()
    if bounds:
        shown.append(rich_utils.RANGE_STRING.format(bounds))
    return rich_utils.types_highlighter(shown)


def _help(param: Any, ctx: Any, markup_mode: Any) -> Any:
    """typer's help text, env var and default, a word too long for the line folded rather
    than cut (``postgresql://user[:password]@host[:…``)."""
    from typer import rich_utils

    shown = rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode)
    for part in shown.renderables:
        if isinstance(part, Text):
            part.overflow = "fold"
    return shown


def options_panel(*, name: str, params: list[Any], ctx: Any, markup_mode: Any,
                  console: Console) -> None:
    from typer import rich_utils

    if not params:
        return
    table = Table(highlight=True, show_header=False, expand=True, box=None, pad_edge=False,
                  padding=(0, 1))
    required = any(p.required for p in params)
    if required:
        table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, overflow="fold")  # names: whole, or folded, never cut
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)  # the help text takes the rest
    for param in params:
        row: list[Any] = [_names(param), _type(param, ctx), _help(param, ctx, markup_mode)]
        if required:
            mark = rich_utils.REQUIRED_SHORT_STRING if param.required else ""
            row.insert(0, Text(mark, style=rich_utils.STYLE_REQUIRED_SHORT))
        table.add_row(*row)
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL))


def paragraphs(parts: list[str], markup_mode: Any) -> str:
    """A command's help after its first paragraph, each paragraph one flowing text: typer
    keeps the docstring's line breaks there, so at 80 columns a sentence broke after two
    words (``(--skip-data-loss:`` / ``print what`` / ``survives and ...``). A paragraph
    that starts with ``\\b`` keeps its lines, as in click."""
    return "\n\n".join(p.strip("\b\n") if p.startswith("\b") else " ".join(p.split())
                       for p in parts)


def command_help(*, help_text: str, markup_mode: Any) -> Any:
    """A command's line in its group's help: the first paragraph as one flowing text
    (typer kept the docstring's line breaks: ``... if it is not`` / ``compatible; ...``)."""
    import inspect

    from typer import rich_utils

    first = inspect.cleandoc(help_text).split("\n\n")[0]
    text = first.replace("\b\n", "") if first.startswith("\b") else " ".join(first.split())
    return rich_utils._make_rich_text(text=text.strip(), style=rich_utils.STYLE_OPTION_HELP,
                                      markup_mode=markup_mode)


def install() -> None:
    """Every command's help lays its options out with :func:`options_panel` and flows its
    paragraphs with :func:`paragraphs` (typer is pinned to one minor version in
    pyproject.toml, as these replace two of its functions). They are put in place when typer
    first formats a help: its ``rich_utils`` imports rich's Markdown and syntax highlighting
    (about a tenth of a command's start-up), and most runs print no help."""
    from typer.core import TyperCommand, TyperGroup

    for cls in (TyperCommand, TyperGroup):
        cls.format_help = _patching_first(cls.format_help)  # type: ignore[method-assign]


def _patching_first(format_help: Callable[..., None]) -> Callable[..., None]:
    def patched(self: Any, ctx: Any, formatter: Any) -> None:
        from typer import rich_utils

        rich_utils._print_options_panel = options_panel
        rich_utils._fix_linebreaks = paragraphs  # type: ignore[assignment]
        rich_utils._make_command_help = command_help
        format_help(self, ctx, formatter)
    return patched
