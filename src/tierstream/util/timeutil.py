"""Parsing times and durations the way every command and option accepts them."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from tierstream.errors import ConfigError

__all__ = ["LAST_MS", "describe_duration", "format_ms", "now_ms", "parse_duration_ms",
           "parse_time_ms"]

#: the first epoch millisecond past 9999-12-31: every time tierstream takes is below it
LAST_MS = 253_402_300_800_000

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


def parse_time_ms(value: object, *, what: str = "time") -> int:
    """Epoch milliseconds from an int, a string of digits, an ISO-8601 string, or a number with
    a unit (``1793664000s``, ``1793664000000ms``).

    A naive ISO time (no offset) is taken as UTC. A bare number between 10^9 and 10^11 is
    refused: as milliseconds it would fall in 1970-1973, so it is almost surely epoch
    *seconds*, and guessing would silently read the wrong window. Raises
    :class:`ConfigError` naming the value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"invalid {what} {value!r}: expected ISO-8601 or epoch milliseconds")
    if isinstance(value, int):
        return _check_range(_not_seconds(value, value, what), value, what)
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=UTC)
        return int(dt.timestamp() * 1000)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+", text):
            return _check_range(_not_seconds(int(text), value, what), value, what)
        unit = re.fullmatch(r"(\d+)(ms|s)", text)
        if unit:
            n = int(unit.group(1)) * (1000 if unit.group(2) == "s" else 1)
            return _check_range(n, value, what)
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
            return round(dt.timestamp() * 1000)
    raise ConfigError(
        f"invalid {what} {value!r}: expected ISO-8601 (e.g. 2026-11-01T00:00:00Z) "
        "or epoch milliseconds (e.g. 1793491200000)"
    )


def _not_seconds(n: int, shown: object, what: str) -> int:
    if 1_000_000_000 <= n < 100_000_000_000:
        as_s = datetime.fromtimestamp(n, tz=UTC).isoformat().replace("+00:00", "Z")
        raise ConfigError(
            f"ambiguous {what} {shown!r}: as epoch milliseconds it is in 1970-1973, so it looks "
            f"like epoch seconds ({as_s}); write {n}s, {n * 1000} (milliseconds) or an "
            "ISO-8601 time")
    return n


def _check_range(ms: int, shown: object, what: str) -> int:
    if not 0 <= ms < LAST_MS:
        raise ConfigError(f"invalid {what} {shown!r}: epoch milliseconds must be in [0, 2.5e14)")
    return ms


def parse_duration_ms(value: object, *, what: str = "duration") -> int:
    """Milliseconds from ``"90s"``, ``"15m"``, ``"2h30m"``, ``"7d"``, ``"500ms"`` or a Python
    int (ms). Text must carry a unit (only ``"0"`` may stand alone): ``--retention 30`` once
    meant 30 milliseconds and deleted a week of data."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text.isdigit():
            if int(text) == 0:
                return 0
            raise ConfigError(
                f"invalid {what} {value!r}: a duration needs a unit, e.g. {text}d, {text}h, "
                f"{text}m, {text}s or {text}ms (a bare number is not taken as milliseconds)")
        pos, total = 0, 0.0
        for m in _DURATION.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT_MS[m.group(2)]
            pos = m.end()
        else:
            if pos == len(text) and pos > 0:
                return int(total)
    raise ConfigError(
        f"invalid {what} {value!r}: expected a non-negative duration "
        "such as 500ms, 30s, 15m, 2h, 7d"
    )


def describe_duration(ms: int) -> str:
    """A duration in words, e.g. ``30 days``, ``1 hour 30 minutes``, ``250 milliseconds``."""
    if ms == 0:
        return "0 seconds"
    parts = []
    rest = ms
    for name, size in (("day", 86_400_000), ("hour", 3_600_000), ("minute", 60_000),
                       ("second", 1000), ("millisecond", 1)):
        n, rest = divmod(rest, size)
        if n:
            parts.append(f"{n} {name}{'s' if n != 1 else ''}")
    return " ".join(parts[:3]) if len(parts) <= 3 else "about " + " ".join(parts[:3])


def format_ms(ms: int | None) -> str:
    """An epoch-ms time as ISO-8601 UTC with milliseconds, or ``-`` for none."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )
