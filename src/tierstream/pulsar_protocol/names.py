"""Pulsar topic names as tierstream topics: ``persistent://tenant/namespace/topic`` is
``tenant/namespace/topic``; ``...-partition-i`` is its partition i; a short name ``my-topic``
is ``public/default/my-topic``, as Pulsar resolves it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierstream.errors import ConfigError
from tierstream.model.names import TopicName

__all__ = ["InvalidTopicName", "PulsarTopic", "parse_pulsar_topic"]

_PARTITION = re.compile(r"^(.*)-partition-(\d+)$")


class InvalidTopicName(ConfigError):
    """A name no topic can have (Pulsar's InvalidTopicName)."""


@dataclass(frozen=True)
class PulsarTopic:
    topic: str  # tierstream's name
    partition: int | None  # None: the topic as a whole (its base name)


def parse_pulsar_topic(name: str) -> PulsarTopic:
    """The tierstream topic (and partition) a Pulsar client means; ConfigError naming what
    is wrong (a non-persistent topic, an old four-part name, an invalid name)."""
    if not isinstance(name, str):  # protobuf hands a string field that is not UTF-8 as bytes
        raise InvalidTopicName(f"invalid topic {name!r}: not UTF-8 text")
    rest = name
    if "://" in name:
        scheme, rest = name.split("://", 1)
        if scheme == "non-persistent":
            raise ConfigError(f"non-persistent topics are not supported ({name!r}): tierstream "
                              "stores every message; use persistent://")
        if scheme != "persistent":
            raise InvalidTopicName(f"invalid topic {name!r}: expected persistent://tenant/"
                              "namespace/topic")
    parts = rest.split("/")
    if len(parts) == 1:
        rest = f"public/default/{rest}"
    elif len(parts) != 3:
        raise InvalidTopicName(f"invalid topic {name!r}: expected tenant/namespace/topic (or a "
                          "short name in public/default)")
    partition = None
    match = _PARTITION.match(rest)
    if match:
        rest, partition = match.group(1), int(match.group(2))
    try:
        return PulsarTopic(str(TopicName.parse(rest)), partition)
    except ConfigError as exc:
        raise InvalidTopicName(str(exc)) from None
