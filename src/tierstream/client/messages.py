"""What a producer sends: messages, their sequence ids, the batches they travel in, and the
key routing of a batch across partitions."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tierstream.errors import ConfigError
from tierstream.model.message_format import PRODUCE_SCHEMA, key_hashes
from tierstream.util.timeutil import LAST_MS, parse_time_ms

if TYPE_CHECKING:
    from tierstream.schemas.codec import Encoder

__all__ = ["Message", "as_message", "check_sequence_ids", "checked_schema", "encoded_messages",
           "routed", "to_batch"]


@dataclass(frozen=True)
class Message:
    """One message as a producer sends it."""

    value: Any  # bytes; with a schema, what it encodes (a dict for AVRO and JSON, a str)
    key: str | None = None
    event_time: int | None = None
    properties: Mapping[str, str] | None = None
    publish_time: int | None = None  # requested; the broker never lets time run backwards
    #: the caller's own id for this message (increasing), as Pulsar clients give one: a
    #: named producer sends nothing whose id its name already stored (see Producer)
    sequence_id: int | None = None


def routed(batch: pa.RecordBatch, p: int, partitions: int
            ) -> list[tuple[int, pa.RecordBatch]]:
    """``batch`` (sent to ``p``) split by the key routing of ``partitions``, in row order
    within each part; rows without a key stay in ``p``."""
    keys = batch.column("key")
    target = key_hashes(keys).to_numpy().astype(np.int64) % partitions
    target[keys.is_null().to_numpy(zero_copy_only=False)] = p
    parts = []
    for q in np.unique(target):
        rows = np.flatnonzero(target == q)
        parts.append((int(q), batch.take(pa.array(rows))))
    return parts


def check_sequence_ids(messages: list[Message]) -> bool:
    """Whether the caller numbered the messages; ConfigError unless all or none are, with
    ids that increase."""
    given = [m.sequence_id for m in messages if m.sequence_id is not None]
    if not given:
        return False
    if len(given) != len(messages):
        raise ConfigError("give every message of a send a sequence_id, or none")
    for i, seq in enumerate(given):
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**63:
            raise ConfigError(f"message {i}: sequence_id {seq!r} must be an integer in "
                              "[0, 2**63)")
    for i, (a, b) in enumerate(itertools.pairwise(given), 1):
        if b <= a:
            raise ConfigError(f"message {i}: sequence_id {b!r} does not increase (the one "
                              f"before is {a!r}): ids must be increasing integers >= 0")
    return True


def to_batch(messages: list[Message]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "key": [m.key for m in messages],
        "value": [m.value for m in messages],
        "publish_time": [m.publish_time for m in messages],
        "event_time": [m.event_time for m in messages],
        "properties": [None if m.properties is None else list(m.properties.items())
                       for m in messages],
    }, schema=PRODUCE_SCHEMA)


def as_message(i: int, m: Message | Mapping[str, Any]) -> Message:
    """Message ``i`` of a send_many call, from a Message or a mapping of its fields, each
    field checked (ConfigError naming the message and the field): a key is text, properties
    map text to text, a time is epoch milliseconds, an ISO-8601 string or a datetime."""
    if isinstance(m, Message):
        return _checked(i, m)
    if not isinstance(m, Mapping):
        raise ConfigError(f"message {i}: expected a Message or a mapping such as "
                          f"{{'value': ..., 'key': ...}}, got {type(m).__name__} {m!r:.60}")
    names = [f.name for f in fields(Message)]
    unknown = sorted(str(k) for k in m if k not in names)
    if unknown or "value" not in m:
        what = f"unknown field(s) {unknown}" if unknown else "no 'value'"
        raise ConfigError(f"message {i}: {what} (a message has {', '.join(names)})")
    return _checked(i, Message(**m))


def _checked(i: int, m: Message) -> Message:
    if m.key is not None and not isinstance(m.key, str):
        raise ConfigError(f"message {i}: key must be text or None, got "
                          f"{type(m.key).__name__} {m.key!r:.60}")
    if m.properties is not None and not (isinstance(m.properties, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in m.properties.items())):
        raise ConfigError(f"message {i}: properties must map text to text, got "
                          f"{m.properties!r:.80}")
    times: dict[str, Any] = {}
    for field in ("event_time", "publish_time"):
        value = getattr(m, field)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and 0 <= value < LAST_MS):
            continue
        if isinstance(value, (str, datetime)):
            times[field] = parse_time_ms(value, what=f"message {i}: {field}")
            continue
        raise ConfigError(f"message {i}: {field} must be epoch milliseconds (an int in "
                          f"[0, {LAST_MS})), an ISO-8601 string or a datetime, got "
                          f"{value!r:.60}")
    return replace(m, **times) if times else m


def encoded_messages(encoder: Encoder | None, topic: str,
                     messages: Iterable[Message | Mapping[str, Any]]) -> list[Message]:
    """Messages with values encoded by the topic's schema ``encoder`` (all checked before
    any is sent); without one, values must be bytes or text."""
    if isinstance(messages, str | bytes | Mapping | Message) or not isinstance(messages,
                                                                          Iterable):
        raise ConfigError(f"invalid messages {messages!r:.60}: expected a list of messages "
                          "(Message objects or mappings such as {'value': ..., 'key': ...})")
    out = [as_message(i, m) for i, m in enumerate(messages)]
    if encoder is None:
        for i, m in enumerate(out):
            if not isinstance(m.value, (bytes, bytearray, memoryview, str)):
                raise ConfigError(
                    f"message {i}: a value of type {type(m.value).__name__} needs a topic "
                    f"schema to encode it ({topic!r} has none: tierstream schema set); "
                    "without one values are bytes or text")
        return out
    props = encoder.properties
    return [Message(encoder.encode(m.value, i), m.key, m.event_time,
                    {**(m.properties or {}), **props}, m.publish_time, m.sequence_id)
            for i, m in enumerate(out)]


def checked_schema(schema: Any) -> tuple[str, str | None] | None:
    """A producer's ``schema`` argument: None, or (type, definition)."""
    if schema is None or (isinstance(schema, tuple | list) and len(schema) == 2
                          and isinstance(schema[0], str) and isinstance(schema[1], str | None)):
        return None if schema is None else (schema[0], schema[1])
    raise ConfigError(f"invalid schema {schema!r}: expected (type, definition), e.g. "
                      "('json', None) or ('avro', '<the Avro schema as JSON text>')")
