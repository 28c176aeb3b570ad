"""Topic names: ``tenant/namespace/topic``, checked before any path is built from them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierstream.errors import ConfigError

__all__ = ["TopicName"]

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


def _check_component(part: str, value: str, whole: str) -> None:
    # fullmatch with an ASCII-only class rejects '..', '/', '\\', NUL, empty, look-alike
    # Unicode and over-long names in one test; '.' and '..' also fail the first-character rule.
    if not isinstance(value, str) or not _COMPONENT.fullmatch(value) or not value.isascii():
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ConfigError(
            f"invalid topic name {whole[:200]!r}: {part} {shown!r} must be 1-128 ASCII characters "
            "from [A-Za-z0-9_.-], starting with a letter or digit"
        )
