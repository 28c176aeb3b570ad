"""The one message schema, and the Key_Shared key hash.

Every entry written to a bookie is one Arrow IPC record-batch message of :data:`MESSAGE_SCHEMA`;
readers slice those batches and add a ``topic`` column (:data:`READ_SCHEMA`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import mmh3
import pyarrow as pa

from tierstream.errors import ConfigError

__all__ = [
    "CONSUMER_SCHEMA",
    "DELIVER_AT",
    "KEY_HASH_SLOTS",
    "MESSAGE_SCHEMA",
    "NONE_KEY",
    "OUTPUT_DDL",
    "OUTPUT_SCHEMA",
    "PRODUCE_SCHEMA",
    "READ_SCHEMA",
    "TIMESTAMP",
    "as_output_batch",
    "as_produce_batch",
    "as_produce_columns",
    "batches_of_about",
    "key_hash",
    "key_hashes",
    "key_range_mask",
    "may_have_property",
    "nulls",
    "spark_ddl",
    "with_topic",
]

#: Key_Shared hash slots: a key hash lies in ``[0, KEY_HASH_SLOTS)``.
KEY_HASH_SLOTS = 65536

#: What Pulsar hashes for a message without a key.
NONE_KEY = "NONE_KEY"

#: A message property: not delivered to shared and key_shared consumers before this time (ms
#: since epoch; Pulsar's deliver_at / deliver_after). Readers see the message at its stored
#: position, with this property.
DELIVER_AT = "tierstream.deliver_at"

_PROPERTIES = pa.map_(pa.string(), pa.string())

MESSAGE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=True),
        pa.field("key_hash", pa.int32(), nullable=False),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("publish_time", pa.int64(), nullable=False),
        pa.field("event_time", pa.int64(), nullable=True),
        pa.field("properties", _PROPERTIES, nullable=True),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("segment_id", pa.int64(), nullable=False),
        pa.field("entry_id", pa.int64(), nullable=False),
        pa.field("batch_index", pa.int32(), nullable=False),
    ]
)

#: What a subscription's consumer receives: each message with how many times it was
#: delivered before (0 the first time).
CONSUMER_SCHEMA = pa.schema([*MESSAGE_SCHEMA, pa.field("redelivery_count", pa.int32(),
                                                       nullable=False)])

#: What readers yield: the message schema with the topic in front.
READ_SCHEMA = pa.schema([pa.field("topic", pa.string(), nullable=False), *MESSAGE_SCHEMA])

#: Publish and event time in tables and DataFrames: UTC instants in microseconds, as Spark's
#: TimestampType and every Parquet reader take them.
TIMESTAMP = pa.timestamp("us", tz="UTC")

_OUTPUT_ORDER = ("topic", "partition", "key", "key_hash", "value", "publish_time", "event_time",
                 "properties", "segment_id", "entry_id", "batch_index")

#: What every table tierstream writes (``read``, ``backfill``, ``tail``) and every Spark
#: DataFrame it returns has: :data:`READ_SCHEMA` with the times as :data:`TIMESTAMP`.
OUTPUT_SCHEMA = pa.schema([
    pa.field(n, TIMESTAMP, READ_SCHEMA.field(n).nullable)
    if n in ("publish_time", "event_time") else READ_SCHEMA.field(n) for n in _OUTPUT_ORDER])


def spark_ddl(schema: pa.Schema) -> str:
    """An Arrow schema as a Spark DDL string (the declared schema of the Spark source; with
    decoded values, the topic's schema as columns)."""
    return ", ".join(f"{_ddl_name(f.name)} {_spark_type(f.type)}"
                     f"{'' if f.nullable else ' not null'}" for f in schema)


def _ddl_name(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else f"`{name}`"


def _spark_type(t: pa.DataType) -> str:
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{_ddl_name(f.name)}:{_spark_type(f.type)}"
                                    for f in t) + ">"
    if pa.types.is_map(t):
        return f"map<{_spark_type(t.key_type)},{_spark_type(t.item_type)}>"
    if pa.types.is_list(t):
        return f"array<{_spark_type(t.value_type)}>"
    if pa.types.is_timestamp(t):
        return "timestamp"
    simple = {pa.string(): "string", pa.binary(): "binary", pa.int32(): "int",
              pa.int64(): "bigint", pa.float32(): "float", pa.float64(): "double",
              pa.bool_(): "boolean", pa.date32(): "date", pa.null(): "string"}
    return simple.get(t, "string")


#: :data:`OUTPUT_SCHEMA` as a Spark DDL string.
OUTPUT_DDL = spark_ddl(OUTPUT_SCHEMA)


def as_output_batch(batch: pa.RecordBatch, schema: pa.Schema = OUTPUT_SCHEMA
                    ) -> pa.RecordBatch:
    """A reader batch (READ_SCHEMA) as exactly :data:`OUTPUT_SCHEMA` (or ``schema``, its
    form with decoded values: schemas/codec.py): ms times become µs."""
    import pyarrow.compute as pc  # here, not at the top: see key_hashes

    columns = []
    for field in schema:
        col = batch.column(field.name)
        if field.type == TIMESTAMP:
            col = pc.multiply(col, pa.scalar(1000, pa.int64())).cast(TIMESTAMP)
        columns.append(col)
    return pa.RecordBatch.from_arrays(columns, schema=schema)


#: What a producer sends: the broker fills in key_hash, positions and the final publish_time.
#: ``publish_time`` here is a *requested* time (null = now); the broker never lets it go backwards.
PRODUCE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=True),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("publish_time", pa.int64(), nullable=True),
        pa.field("event_time", pa.int64(), nullable=True),
        pa.field("properties", _PROPERTIES, nullable=True),
    ]
)


def key_hash(key: str | None) -> int:
    """Pulsar's Key_Shared slot of ``key``: ``(murmur3_32(utf8, seed 0) & 0x7fffffff) % 65536``."""
    data = (NONE_KEY if key is None else key).encode("utf-8")
    return (mmh3.hash(data, 0, signed=False) & 0x7FFFFFFF) % KEY_HASH_SLOTS


@functools.lru_cache(maxsize=16)
def _unkeyed_hashes(n: int) -> pa.Array:
    """The key hashes of ``n`` unkeyed messages (kept: a producer's batches repeat sizes)."""
    return pa.repeat(pa.scalar(key_hash(None), pa.int32()), n)


def key_hashes(keys: pa.Array | Sequence[str | None]) -> pa.Array:
    """The key hash of every key, as an int32 array (null keys hash as :data:`NONE_KEY`)."""
    arr = keys if isinstance(keys, pa.Array) else pa.array(keys, type=pa.string())
    if arr.null_count == len(arr):  # no keys (unkeyed messages): one hash for all
        return _unkeyed_hashes(len(arr))
    # pyarrow.compute is imported where it is used: every tierstream process imports this
    # module, and most CLI commands never compute (it is 70 ms of a 0.5 s start)
    import numpy as np
    import pyarrow.compute as pc

    # Hash each distinct key once (batches often repeat a few keys many times), with one
    # mmh3 call each (it encodes a str as UTF-8 itself) and the slot arithmetic in numpy: on
    # the broker's produce path this is per message, and a Python function per key was a
    # quarter of the broker's CPU for a batch of a thousand distinct keys.
    encoded = pc.dictionary_encode(arr)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    words = np.array([mmh3.hash(k, 0, False) for k in encoded.dictionary.to_pylist()],
                     dtype=np.uint32)
    slots = ((words & np.uint32(0x7FFFFFFF)) % np.uint32(KEY_HASH_SLOTS)).astype(np.int32)
    indices = encoded.indices
    if indices.null_count:  # null keys hash as NONE_KEY: one more slot, after the others
        slots = np.append(slots, np.int32(key_hash(None)))
        indices = indices.fill_null(len(slots) - 1)
    return pa.array(slots[indices.to_numpy(zero_copy_only=False)], type=pa.int32())


def key_range_mask(key_hash: pa.Array, ranges: Sequence[tuple[int, int]]) -> pa.Array | None:
    """A mask of the rows whose key hash lies in one of the half-open ``ranges`` ``[lo, hi)``;
    None when they cover every slot (nothing to filter). The one key-range filter: the broker
    and the readers both use it."""
    if not ranges or any(lo <= 0 and hi >= KEY_HASH_SLOTS for lo, hi in ranges):
        return None
    if isinstance(key_hash, pa.Array) and key_hash.null_count == 0:
        # numpy over the zero-copy values: one pass per bound instead of an Arrow kernel
        # call each (readers filter every entry of a key-range split: small batches, many)
        values = key_hash.to_numpy(zero_copy_only=True)
        hit = None
        for lo, hi in ranges:
            m = (values >= lo) & (values < hi)
            hit = m if hit is None else hit | m
        return pa.array(hit, type=pa.bool_())
    import pyarrow.compute as pc  # see key_hashes

    mask = None
    for lo, hi in ranges:
        m = pc.and_(pc.greater_equal(key_hash, lo), pc.less(key_hash, hi))
        mask = m if mask is None else pc.or_(mask, m)
    return mask


def with_topic(batch: pa.RecordBatch, topic: str) -> pa.RecordBatch:
    """``batch`` (of :data:`MESSAGE_SCHEMA`) with a constant ``topic`` column in front."""
    # add_column is ~15x cheaper than from_arrays(schema=...), which re-validates every column
    return batch.add_column(0, _TOPIC_FIELD, _topic_column(topic, batch.num_rows))


_TOPIC_COLUMNS: dict[str, pa.Array] = {}
_TOPIC_FIELD = READ_SCHEMA.field(0)


def _topic_column(topic: str, n: int) -> pa.Array:
    """A zero-copy slice of a cached constant column (readers add one to every batch)."""
    column = _TOPIC_COLUMNS.get(topic)
    if column is None or len(column) < n:
        if len(_TOPIC_COLUMNS) > 1024:
            _TOPIC_COLUMNS.clear()
        column = _TOPIC_COLUMNS[topic] = pa.repeat(pa.scalar(topic, pa.string()),
                                                   max(n, 65536))
    return column.slice(0, n)


def batches_of_about(table: pa.Table, nbytes: int) -> list[pa.RecordBatch]:
    """``table`` as record batches of about ``nbytes`` each (by its mean row size): the same
    boundaries for the same table every time."""
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    return list(table.to_batches(max_chunksize=max(1, nbytes // per_row)))


def as_produce_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with exactly the columns of PRODUCE_SCHEMA (missing optional ones as nulls)."""
    if batch.schema.equals(PRODUCE_SCHEMA):  # already so (a Pulsar SEND's rows, most streams)
        # only the columns that must not hold nulls: each column or field pyarrow hands out
        # is a new Python object (with its type's), ~9,000 instructions on every batch
        for at in _NOT_NULLABLE:
            _refuse_nulls(at, batch.column(at))
        return batch
    return _conformed(batch)


def as_produce_columns(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[pa.Array]]:
    """:func:`as_produce_batch` and its columns, in PRODUCE_SCHEMA's order: the broker's
    append asks pyarrow for them once (each is a new Python object, ~9,000 instructions;
    they were asked for eight times on every batch)."""
    if batch.schema.equals(PRODUCE_SCHEMA):
        columns = batch.columns
        for at in _NOT_NULLABLE:
            _refuse_nulls(at, columns[at])
        return batch, columns
    batch = _conformed(batch)
    return batch, batch.columns


def _conformed(batch: pa.RecordBatch) -> pa.RecordBatch:
    """:func:`as_produce_batch` of a batch whose schema is not PRODUCE_SCHEMA."""
    names = set(batch.schema.names)
    unknown = names - set(PRODUCE_SCHEMA.names)
    if unknown:
        raise ConfigError(
            f"unknown column(s) {sorted(unknown)} in produced batch; expected "
            f"{PRODUCE_SCHEMA.names}"
        )
    if "value" not in names:
        raise ConfigError("a produced batch needs a 'value' column (binary)")
    columns = []
    for at, field_ in enumerate(PRODUCE_SCHEMA):
        if field_.name in names:
            col = batch.column(field_.name)
            if col.type != field_.type:
                try:
                    col = col.cast(field_.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    raise ConfigError(
                        f"column {field_.name!r} has type {col.type}, expected {field_.type}"
                    ) from None
            _refuse_nulls(at, col)
        else:
            col = nulls(batch.num_rows, field_.type)
        columns.append(col)
    return pa.RecordBatch.from_arrays(columns, schema=PRODUCE_SCHEMA)


_NOT_NULLABLE = [i for i, f in enumerate(PRODUCE_SCHEMA) if not f.nullable]


def _refuse_nulls(at: int, col: pa.Array) -> None:
    """Refuse nulls in column ``at`` of PRODUCE_SCHEMA if it must not have them (the field
    is asked for only then: see :func:`as_produce_columns`)."""
    if col.null_count and not PRODUCE_SCHEMA.field(at).nullable:
        raise ConfigError(f"column {PRODUCE_SCHEMA.field(at).name!r} has nulls; it must not")




def may_have_property(properties: pa.Array, name: str) -> bool:
    """Whether a message of ``properties`` (a map column) may have property ``name``: False
    when no key of the map holds its bytes — one search over the keys' bytes, where a lookup
    in every message's map is an Arrow step per message (~300 instructions) — so that a
    batch without the property is not looked through message by message."""
    if len(properties) == 0 or properties.null_count == len(properties):
        return False
    data = properties.keys.buffers()[2]  # every key's bytes (those of a slice, and perhaps more)
    return data is not None and name.encode() in data.to_pybytes()


@functools.lru_cache(maxsize=64)
def nulls(n: int, type_: pa.DataType) -> pa.Array:
    """``pa.nulls(n, type_)``, kept: batches repeat sizes, and each call made a new array
    (~16,000 instructions for 1,000 rows)."""
    return pa.nulls(n, type_)
