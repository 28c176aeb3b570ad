"""Which tier cache (tier/cache.py) a process uses: the one given to a read, else the
environment's (``TIERSTREAM_TIER_CACHE_DIR``, ``TIERSTREAM_TIER_CACHE_SIZE``: the CLI's
``--tier-cache-size`` sets the latter, for its Spark workers too), else the default directory
with a tenth of its free disk; one open :class:`TierCache` per directory and size."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from tierstream.errors import ConfigError
from tierstream.tier.cache import TierCache
from tierstream.util.units import cache_bytes

__all__ = ["DIR_ENV", "SIZE_ENV", "default_directory", "host_cache", "parse_cache_size"]

log = logging.getLogger(__name__)

#: The environment variables a host's cache is set with.
DIR_ENV = "TIERSTREAM_TIER_CACHE_DIR"
SIZE_ENV = "TIERSTREAM_TIER_CACHE_SIZE"


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierstream" / "tier"


def parse_cache_size(raw: Any, what: str) -> int:
    """``0``/``off`` (no cache) or a size such as ``2GiB``; ConfigError naming ``what``."""
    try:
        return cache_bytes(raw)
    except (ValueError, TypeError):
        raise ConfigError(f"invalid {what}: {raw!r}; expected 0 (off) or a size such as "
                          "2GiB") from None


_open: dict[tuple[str, int | None], TierCache] = {}
_open_lock = threading.Lock()
#: which of _open host_cache answered, by its arguments, the working directory (a relative
#: directory) and the environment variables it reads; None: no cache
_asked: dict[tuple[Any, ...], tuple[str, int | None] | None] = {}
_ENV = (DIR_ENV, SIZE_ENV, "XDG_CACHE_HOME", "HOME")
_UNKNOWN: Any = object()


def host_cache(directory: str | None = None, size: int | None = None) -> TierCache | None:
    """This host's cache of tier bytes, or None when it is off (size 0). Given values win, then
    ``TIERSTREAM_TIER_CACHE_DIR``/``_SIZE``, then the default directory and a tenth of its
    free disk (at most 20 GiB)."""
    # every tier file a read opens asks: the same arguments and environment, the same cache
    # (resolving the directory again cost a tenth of a cached file's read)
    asked = (directory, size, os.getcwd() if directory else None,
             *(os.environ.get(k) for k in _ENV))
    where = _asked.get(asked, _UNKNOWN)
    if where is None:
        return None
    if where is not _UNKNOWN and (cache := _open.get(where)) is not None:
        return cache
    where, cache = _host_cache(directory, size)
    with _open_lock:
        _asked[asked] = where
    return cache


def _host_cache(directory: str | None, size: int | None
                ) -> tuple[tuple[str, int | None] | None, TierCache | None]:
    """The cache asked for and its key in ``_open`` (None, None: no cache)."""
    directory = directory or os.environ.get(DIR_ENV) or None
    if size is None and os.environ.get(SIZE_ENV):
        size = parse_cache_size(os.environ[SIZE_ENV], f"environment variable {SIZE_ENV}")
    if size == 0:
        return None, None
    where = str(Path(directory).expanduser().resolve()) if directory else \
        str(default_directory())
    key = (where, size)
    with _open_lock:
        cache = _open.get(key)
        if cache is None:
            try:
                cache = _open[key] = TierCache(where, size)
            except ConfigError:
                if directory:
                    raise
                log.warning("the default tier cache directory %s cannot be used: reading "
                            "without a cache (set %s)", where, DIR_ENV)
                return None, None
        return key, cache
