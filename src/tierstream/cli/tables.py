"""Tables that fit the terminal: rich shrinks every column of a table wider than the screen
to a few characters and an ellipsis; here the least important columns are left out first
(and said so), and what still does not fit wraps instead of being cut."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["fitted_table", "hidden_note"]

_BORDER = 3  # a column's padding and its rule, in a box table


def fitted_table(console: Console, headers: Sequence[str], rows: Sequence[Sequence[str]], *,
                 drop_first: Sequence[str] = (), title: str | None = None
                 ) -> tuple[Table, list[str]]:
    """A table of ``rows`` under ``headers`` as wide as ``console``: the columns named in
    ``drop_first`` (in that order) are left out while the rest would not fit, and the others
    wrap (folding long values) rather than end in an ellipsis. Returns the table and the
    headers left out."""
    keep = list(range(len(headers)))
    natural = [max([_widest_word(h)] + [_widest_line(r[i]) for r in rows])
               for i, h in enumerate(headers)]
    dropped: list[str] = []
    for name in drop_first:
        if sum(natural[i] + _BORDER for i in keep) + 1 <= console.width:
            break
        i = headers.index(name)
        keep.remove(i)
        dropped.append(name)
    table = Table(title=title)
    for i in keep:
        table.add_column(headers[i], overflow="fold", min_width=min(natural[i], 12))
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table, dropped


def hidden_note(dropped: Sequence[str]) -> Text | None:
    """The line under a table that says which columns did not fit (None: all did)."""
    if not dropped:
        return None
    return Text(f"hidden at this width: {', '.join(dropped)} (--json shows all)", style="dim")


def _widest_line(cell: str) -> int:
    return max((len(line) for line in cell.splitlines()), default=0)


def _widest_word(header: str) -> int:
    return max((len(word) for word in header.split()), default=0)
