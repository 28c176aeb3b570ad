"""Checks of the Python API's arguments, shared by its public entries (``tierstream.read`` and
its kin, the clients): each returns the value in the type the code needs, or raises one
ConfigError naming the argument and the value. A duration as the CLI and the Spark options
take it ("30s") is taken where seconds are; anything else is refused at the boundary, not
found later as a TypeError deep inside.
"""

from __future__ import annotations

from typing import Any, Literal, overload

from tierstream.errors import ConfigError
from tierstream.util.timeutil import parse_duration_ms

__all__ = ["flag", "instance", "positive_int", "seconds", "text"]


@overload
def positive_int(value: Any, what: str, *, none_ok: Literal[False] = ...) -> int: ...
@overload
def positive_int(value: Any, what: str, *, none_ok: bool) -> int | None: ...
def positive_int(value: Any, what: str, *, none_ok: bool = False) -> int | None:
    """An integer >= 1 (``None`` too where ``none_ok``)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"invalid {what} {value!r}: expected an integer >= 1"
                          + (", or None" if none_ok else ""))
    return value


@overload
def seconds(value: Any, what: str, *, none_ok: Literal[False] = ..., zero_ok: bool = ...
            ) -> float: ...
@overload
def seconds(value: Any, what: str, *, none_ok: bool, zero_ok: bool = ...) -> float | None: ...
def seconds(value: Any, what: str, *, none_ok: bool = False, zero_ok: bool = True
            ) -> float | None:
    """Seconds as a number, or a duration with its unit (``"30s"``, ``"500ms"``)."""
    if value is None and none_ok:
        return None
    if isinstance(value, str):
        got = parse_duration_ms(value, what=what) / 1000
    elif isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 \
            or value == float("inf"):
        got = -1.0
    else:
        got = float(value)
    if got < 0 or (got == 0 and not zero_ok):
        least = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"invalid {what} {value!r}: expected seconds {least} or a duration "
                          "such as '30s'" + (", or None" if none_ok else ""))
    return got


@overload
def text(value: Any, what: str, *, none_ok: Literal[False] = ...) -> str: ...
@overload
def text(value: Any, what: str, *, none_ok: bool) -> str | None: ...
def text(value: Any, what: str, *, none_ok: bool = False) -> str | None:
    """A non-empty string (``None`` too where ``none_ok``)."""
    if value is None and none_ok:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"invalid {what} {value!r}: expected a non-empty string"
                          + (", or None" if none_ok else ""))
    return value


def flag(value: Any, what: str) -> bool:
    """True or False (not 0, "no" or a list: a typo there would read data differently)."""
    if not isinstance(value, bool):
        raise ConfigError(f"invalid {what} {value!r}: expected True or False")
    return value


def instance(value: Any, what: str, kind: type, expected: str, *, none_ok: bool = True) -> Any:
    """``value`` if it is a ``kind`` (or None where ``none_ok``)."""
    if (value is None and none_ok) or isinstance(value, kind):
        return value
    raise ConfigError(f"invalid {what} {value!r}: expected {expected}")
