"""Topic names: ``tenant/namespace/topic``, checked before any path is built from them."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConfigError

__all__ = ["TopicName", "check_txn_id"]

_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PARTS = ("tenant", "namespace", "topic")


@dataclass(frozen=True, order=True)
class TopicName:
    """A validated topic name. Build one with :meth:`parse`; ``str()`` gives it back."""

    tenant: str
    namespace: str
    topic: str

    def __post_init__(self) -> None:
        for part, value in zip(_PARTS, (self.tenant, self.namespace, self.topic), strict=True):
            _check_component(part, value, f"{self.tenant}/{self.namespace}/{self.topic}")

    @classmethod
    def parse(cls, name: object) -> TopicName:
        """Parse ``tenant/namespace/topic``; raises :class:`ConfigError` naming the bad value."""
        if isinstance(name, TopicName):
            return name
        if not isinstance(name, str):
            raise ConfigError(f"topic name must be a string, got {type(name).__name__}: {name!r}")
        return _parsed(name)

    @classmethod
    def _checked(cls, name: str) -> TopicName:
        parts = name.split("/")
        if len(parts) != 3:
            raise ConfigError(
                f"invalid topic name {name!r}: expected tenant/namespace/topic "
                f"(three components separated by '/'), got {len(parts)} component(s)"
            )
        for part, value in zip(_PARTS, parts, strict=True):
            _check_component(part, value, name)
        return cls(*parts)

    @property
    def path_parts(self) -> tuple[str, str, str]:
        """The components, safe to join into a filesystem path or URL."""
        return (self.tenant, self.namespace, self.topic)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.namespace}/{self.topic}"


@functools.lru_cache(maxsize=4096)
def _parsed(name: str) -> TopicName:
    """A valid name's parse, kept: the broker parses the same few names on every request
    (each parse checks each component twice, ~30 µs); a bad one raises, and is not kept."""
    return TopicName._checked(name)


def _check_component(part: str, value: str, whole: str) -> None:
    # fullmatch with an ASCII-only class rejects '..', '/', '\\', NUL, empty, look-alike
    # Unicode and over-long names in one test; '.' and '..' also fail the first-character rule.
    if not isinstance(value, str) or not _COMPONENT.fullmatch(value) or not value.isascii():
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ConfigError(
            f"invalid topic name {whole[:200]!r}: {part} {shown!r} must be 1-128 ASCII characters "
            "from [A-Za-z0-9_.-], starting with a letter or digit"
        )


def check_txn_id(txn_id: Any) -> str:
    """A transaction id as given by a client: 1-64 of ``[A-Za-z0-9_.-]``, not only dots."""
    text = str(txn_id)
    if not (0 < len(text) <= 64 and all(c.isalnum() or c in "_.-" for c in text)
            and text.isascii() and text.strip(".")):
        raise ConfigError(f"invalid transaction id {text[:80]!r}: expected 1-64 characters "
                          "of A-Z a-z 0-9 _ . -")
    return text
