"""What a topic may be created with, and its settings: one rule each, applied where every
client's request ends up (the metadata store, below the CLI, the Python ``Admin``, Flight,
the Pulsar admin API and auto-creation) and shared with the CLI's own early checks."""

from __future__ import annotations

import re

from tierstream.errors import ConfigError
from tierstream.model.names import TopicName
from tierstream.util.timeutil import parse_duration_ms

__all__ = ["MAX_RETENTION_MS", "check_new_topic", "check_partition_count", "check_retention"]

_PARTITION_SUFFIX = re.compile(r"^(.*)-partition-(\d+)$")

#: ~292 million years: a retention longer is a typo (and would not fit the metadata's integer)
MAX_RETENTION_MS = 2**63 // 1000


def check_new_topic(name: object) -> TopicName:
    """A name a new topic may take: valid, and not one that Pulsar clients read as another
    topic's partition (``t-partition-1`` is partition 1 of ``t``: a producer of that name
    would write into ``t`` and the new topic would stay empty)."""
    topic = TopicName.parse(name)
    match = _PARTITION_SUFFIX.match(topic.topic)
    if match:
        base = f"{topic.tenant}/{topic.namespace}/{match.group(1)}"
        raise ConfigError(
            f"invalid topic name {str(topic)!r}: a name ending in -partition-{match.group(2)} "
            f"is how Pulsar names partition {match.group(2)} of topic {base!r}, so its "
            "messages would go there; choose a name that does not end in -partition-<number>")
    return topic


def check_partition_count(partitions: object, topic: object) -> int:
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise ConfigError(f"invalid partition count {partitions!r} for topic {str(topic)!r}: "
                          "expected an integer >= 1")
    return partitions


def check_retention(value: object, *, what: str = "retention") -> int | None:
    """A topic's retention in milliseconds from what a client gave: None (keep every
    message), an int of milliseconds, or a duration with a unit such as ``"30d"``. A bare
    number as text (``"7"``: 7 ms, every closed segment deleted at the next pass), a
    negative, fractional or boolean value, or an unknown unit is refused naming the value."""
    if value is None:
        return None
    ms = parse_duration_ms(value, what=what)
    if ms > MAX_RETENTION_MS:
        raise ConfigError(f"invalid {what} {value!r}: longer than any store keeps data; give "
                          "at most a few thousand years (e.g. 3650d), or no retention to keep "
                          "every message")
    return ms
