"""``tierstream cache stats|clear``: this host's cache of tier bytes (tier/cache.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tierstream.cli.common import app, err, human_bytes, out
from tierstream.errors import ConfigError
from tierstream.tier.cache import TierCache
from tierstream.tier.host_cache import default_directory

__all__ = ["cache_app"]

cache_app = typer.Typer(help="This host's cache of tier files read from object storage.",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")

DirOpt = Annotated[Path | None, typer.Option(
    "--dir", envvar="TIERSTREAM_TIER_CACHE_DIR", show_envvar=True,
    help="The cache's directory \\[default: ~/.cache/tierstream/tier].")]


def _open(directory: Path | None) -> TierCache:
    where = directory or default_directory()
    if not (where / "index.sqlite3").exists():
        raise ConfigError(f"no tier cache in {str(where)!r} (a read of a remote tier makes "
                          "one; --dir or TIERSTREAM_TIER_CACHE_DIR names another)")
    return TierCache(where, 0)  # the limit is the readers' to set: 0 here, never used


@cache_app.command("stats")
def cache_stats_cmd(
    directory: DirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the stats as JSON.")] = False,
) -> None:
    """Show what the cache holds and has served.

    Over every process that used it since it was made or cleared: hits and misses (blocks of
    tier files), bytes from the cache and from the object store, evictions, blocks not kept,
    corrupt entries dropped.

    Example: tierstream cache stats
    """
    cache = _open(directory)
    stats = cache.stats()
    if as_json:
        out.print_json(json.dumps({k: v for k, v in stats.to_dict().items() if k != "limit"}))
        return
    asked = stats.hits + stats.misses
    table = Table(title=f"tier cache {stats.directory}", show_header=False)
    table.add_row("size", f"{human_bytes(stats.size)} in {stats.entries:,} block(s)")
    table.add_row("hits", f"{stats.hits:,} of {asked:,} block reads"
                  + (f" ({stats.hits / asked:.0%})" if asked else ""))
    table.add_row("from the cache", human_bytes(stats.hit_bytes))
    table.add_row("from the object store", human_bytes(stats.miss_bytes))
    table.add_row("evictions", f"{stats.evictions:,}")
    table.add_row("not kept", f"{stats.rejected:,} (read less often than what they would "
                  "evict)")
    table.add_row("corrupt, dropped", f"{stats.corrupt:,}")
    out.print(table)


@cache_app.command("clear")
def cache_clear_cmd(
    directory: DirOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
) -> None:
    """Remove every cached block and reset the counts.

    Readers on this host fetch from the object store again; nothing in the store changes.

    Example: tierstream cache clear --yes
    """
    cache = _open(directory)
    if not yes and not typer.confirm(f"remove every block of {cache.directory}?"):
        err.print("nothing removed")
        raise typer.Exit(1)
    freed = cache.clear()
    out.print(f"cleared {cache.directory}: {human_bytes(freed)} freed")
