import pyarrow as pa
import pytest

from tierstream.errors import ConfigError
from tierstream.model.message_format import (
    MESSAGE_SCHEMA,
    NONE_KEY,
    READ_SCHEMA,
    as_produce_batch,
    key_hash,
    key_hashes,
    with_topic,
)

# Published MurmurHash3_x86_32 vectors (seed 0): the hash Pulsar's Key_Shared uses.
MURMUR3_VECTORS = {
    "": 0x00000000,
    "hello": 0x248BFA47,
    "Hello, world!": 0xC0363E43,
    "The quick brown fox jumps over the lazy dog": 0x2E4FF723,
}


@pytest.mark.parametrize(("key", "murmur"), MURMUR3_VECTORS.items())
def test_key_hash_follows_pulsar_key_shared_rule(key: str, murmur: int) -> None:
    assert key_hash(key) == (murmur & 0x7FFFFFFF) % 65536


def test_key_hash_of_no_key_is_the_hash_of_none_key() -> None:
    assert key_hash(None) == key_hash(NONE_KEY)


def test_vectorised_key_hashes_match_scalar_ones() -> None:
    keys = ["a", None, "b", "a", "ünïcode", None, "", "漢字😀", "x" * 300, *MURMUR3_VECTORS]
    assert key_hashes(pa.array(keys)).to_pylist() == [key_hash(k) for k in keys]
    assert key_hashes(pa.array(keys).slice(3, 5)).to_pylist() == [key_hash(k)
                                                                  for k in keys[3:8]]
    assert key_hashes(pa.chunked_array([keys[:4], keys[4:]])).to_pylist() == [
        key_hash(k) for k in keys]
    assert key_hashes(pa.array(["k"] * 3)).to_pylist() == [key_hash("k")] * 3


def test_read_schema_is_topic_then_message_schema() -> None:
    assert READ_SCHEMA.names == ["topic", *MESSAGE_SCHEMA.names]
    batch = as_produce_batch(pa.record_batch({"value": [b"x"]}))
    assert batch.column("key").null_count == 1


def test_with_topic_prepends_a_constant_topic_column() -> None:
    empty = pa.RecordBatch.from_pylist([], schema=MESSAGE_SCHEMA)
    assert with_topic(empty, "a/b/c").schema == READ_SCHEMA


def test_produce_batch_rejects_unknown_columns_and_null_values() -> None:
    with pytest.raises(ConfigError, match="unknown column"):
        as_produce_batch(pa.record_batch({"value": [b"x"], "colour": ["red"]}))
    with pytest.raises(ConfigError, match="'value'"):
        as_produce_batch(pa.record_batch({"value": pa.array([None], pa.binary())}))
