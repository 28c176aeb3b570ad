"""Values decoded a column at a time give exactly what decoding them one by one gives: the
same column, the same errors, in every mode, for random schemas, values, schema evolutions and
corrupted bytes (the value-by-value path is the reference)."""

from __future__ import annotations

import datetime as dt
import io
import json

import fastavro
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstream.errors import ConfigError
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.schemas.codec import Decoder, decode_batch
from tierstream.schemas.model import MODES, VERSION_PROPERTY, SchemaInfo, SchemaType, canonical

TOPIC = "t/n/columns"


def _info(version: int, type_: SchemaType, definition: object) -> SchemaInfo:
    text, fingerprint = canonical(type_, json.dumps(definition))
    return SchemaInfo(TOPIC, version, type_, text, fingerprint, 0)


def _batch(values: list[bytes], versions: list[int]) -> pa.RecordBatch:
    n = len(values)
    props = [[(VERSION_PROPERTY, str(v))] if v else None for v in versions]
    return pa.RecordBatch.from_pydict({
        "key": pa.nulls(n, pa.string()), "key_hash": pa.array([0] * n, pa.int32()),
        "value": pa.array(values, pa.binary()),
        "publish_time": pa.array(range(n), pa.int64()), "event_time": pa.nulls(n, pa.int64()),
        "properties": pa.array(props, pa.map_(pa.string(), pa.string())),
        "partition": pa.array([0] * n, pa.int32()), "segment_id": pa.array([1] * n, pa.int64()),
        "entry_id": pa.array([0] * n, pa.int64()), "batch_index": pa.array(range(n), pa.int32()),
    }, schema=MESSAGE_SCHEMA)


def _both(batch: pa.RecordBatch, versions: list[SchemaInfo], mode: str) -> None:
    """decode_batch with and without the column decoders: equal results or equal errors."""
    results = []
    for vectorised in (True, False):
        decoder = Decoder(versions)
        decoder.vectorised = vectorised
        dropped = [0]
        try:
            results.append(("ok", decode_batch(batch, decoder, mode, TOPIC, dropped),
                            dropped[0]))
        except ConfigError as exc:
            results.append(("error", str(exc), 0))
    (kind, fast, fast_dropped), (ref_kind, ref, ref_dropped) = results
    assert kind == ref_kind, (fast, ref)
    if kind == "ok":
        assert fast.schema == ref.schema
        # a corrupted double may decode to NaN, which is not equal to itself: compare the text
        assert repr(fast.to_pylist()) == repr(ref.to_pylist())
        assert fast_dropped == ref_dropped
    else:
        assert fast == ref


# -- random Avro schemas and values --------------------------------------------------------

_names = iter(f"R{i}" for i in range(10**9))
PRIMITIVE_VALUES = {
    "boolean": st.booleans(),
    "int": st.integers(-(2**31), 2**31 - 1),
    "long": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(width=32, allow_nan=False),
    "double": st.floats(allow_nan=False),
    "bytes": st.binary(max_size=20),
    "string": st.text(max_size=12),
}


@st.composite
def avro_types(draw: st.DrawFn, depth: int = 0) -> tuple[object, st.SearchStrategy[object]]:
    """(an Avro schema, a strategy for its values)."""
    choices = ["primitive"] * 4 + ["nullable", "enum", "fixed", "timestamp", "date"]
    if depth < 2:
        choices += ["record", "array", "map"]
    kind = draw(st.sampled_from(choices))
    if kind == "primitive":
        name = draw(st.sampled_from(sorted(PRIMITIVE_VALUES)))
        return name, PRIMITIVE_VALUES[name]
    if kind == "nullable":
        inner, values = draw(avro_types(depth + 1))
        if isinstance(inner, list):
            return inner, values
        order = draw(st.booleans())
        return (["null", inner] if order else [inner, "null"]), st.none() | values
    if kind == "enum":
        symbols = draw(st.lists(st.sampled_from("ABCDEFG"), min_size=1, max_size=5,
                                unique=True))
        return {"type": "enum", "name": next(_names), "symbols": symbols}, \
            st.sampled_from(symbols)
    if kind == "fixed":
        size = draw(st.integers(0, 6))
        return {"type": "fixed", "name": next(_names), "size": size}, \
            st.binary(min_size=size, max_size=size)
    if kind == "timestamp":
        unit = draw(st.sampled_from(["timestamp-millis", "timestamp-micros"]))
        return {"type": "long", "logicalType": unit}, st.datetimes(
            min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1),
            timezones=st.just(dt.UTC)).map(
            lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)
            if unit == "timestamp-millis" else d)
    if kind == "date":
        return {"type": "int", "logicalType": "date"}, st.dates(dt.date(1900, 1, 1),
                                                                dt.date(2200, 1, 1))
    if kind == "array":
        inner, values = draw(avro_types(depth + 1))
        return {"type": "array", "items": inner}, st.lists(values, max_size=4)
    if kind == "map":
        inner, values = draw(avro_types(depth + 1))
        return {"type": "map", "values": inner}, st.dictionaries(st.text(max_size=4), values,
                                                                 max_size=3)
    fields = []
    strategies = {}
    for i in range(draw(st.integers(0, 4))):
        inner, values = draw(avro_types(depth + 1))
        fields.append({"name": f"f{i}", "type": inner})
        strategies[f"f{i}"] = values
    return {"type": "record", "name": next(_names), "fields": fields}, \
        st.fixed_dictionaries(strategies)


@st.composite
def avro_records(draw: st.DrawFn) -> tuple[dict[str, object], list[object]]:
    schema, values = draw(avro_types(depth=1).filter(lambda t: isinstance(t[0], dict)
                                                     and t[0].get("type") == "record")
                          | st.builds(lambda: None).flatmap(lambda _: _top()))
    return schema, draw(st.lists(values, min_size=1, max_size=12))


def _top() -> st.SearchStrategy[tuple[dict[str, object], st.SearchStrategy[object]]]:
    return st.lists(avro_types(depth=1), min_size=1, max_size=5).map(lambda fs: (
        {"type": "record", "name": next(_names),
         "fields": [{"name": f"f{i}", "type": t} for i, (t, _) in enumerate(fs)]},
        st.fixed_dictionaries({f"f{i}": v for i, (_, v) in enumerate(fs)})))


def _encode(schema: object, record: object) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(avro_records(), st.sampled_from(MODES))
def test_random_avro_values_decode_the_same_by_column_and_by_value(case, mode) -> None:
    schema, records = case
    info = _info(1, SchemaType.AVRO, schema)
    batch = _batch([_encode(schema, r) for r in records], [1] * len(records))
    _both(batch, [info], mode)
    # and it was the column path that decoded them: every type drawn here is one it takes
    assert Decoder([info]).decode_column(batch.column("value"), np.ones(len(records),
                                                                        np.int64)) is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(avro_records(), st.data(), st.sampled_from(MODES))
def test_corrupted_avro_values_fail_or_decode_the_same_way(case, data, mode) -> None:
    schema, records = case
    values = [_encode(schema, r) for r in records]
    i = data.draw(st.integers(0, len(values) - 1))
    how = data.draw(st.sampled_from(["truncate", "extend", "flip", "random"]))
    v = values[i]
    if how == "truncate":
        values[i] = v[:data.draw(st.integers(0, max(0, len(v) - 1)))]
    elif how == "extend":
        values[i] = v + data.draw(st.binary(min_size=1, max_size=4))
    elif how == "flip" and v:
        at = data.draw(st.integers(0, len(v) - 1))
        values[i] = v[:at] + bytes([v[at] ^ data.draw(st.integers(1, 255))]) + v[at + 1:]
    else:
        values[i] = data.draw(st.binary(max_size=30))
    batch = _batch(values, [1] * len(values))
    _both(batch, [_info(1, SchemaType.AVRO, schema)], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("logical", "kind", "bad"), [
    ("date", "int", 3_000_000), ("date", "int", -800_000),
    ("timestamp-millis", "long", 2**62), ("timestamp-micros", "long", -(2**62))])
def test_dates_and_times_past_the_year_9999_are_bad_values_by_column_too(
        logical: str, kind: str, bad: int, mode: str) -> None:
    """Regression (found by the property test above on a CI run): a corrupted date decoded by
    column to a day past the year 9999, which no reader can turn into a date, where the value
    decoder rejects the value; a timestamp of millis overflowed. Both paths agree now."""
    raw = {"type": "record", "name": "T", "fields": [{"name": "t", "type": kind}]}
    schema = {**raw, "fields": [{"name": "t", "type": {"type": kind, "logicalType": logical}}]}
    values = [_encode(raw, {"t": t}) for t in (0, bad, 1)]
    _both(_batch(values, [1] * 3), [_info(1, SchemaType.AVRO, schema)], mode)


# -- schema evolution: old versions resolved into the latest --------------------------------

V1 = {"type": "record", "name": "Click", "namespace": "acme", "fields": [
    {"name": "user", "type": "string"},
    {"name": "n", "type": "int"},
    {"name": "score", "type": "float"},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
    {"name": "tags", "type": {"type": "array", "items": "int"}},
    {"name": "gone", "type": ["null", "string"]},
]}
V2 = {"type": "record", "name": "Click", "namespace": "acme", "fields": [
    {"name": "user", "type": "string"},
    {"name": "n", "type": "long"},                          # promoted
    {"name": "score", "type": "double"},                    # promoted
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B", "C"],
                              "default": "A"}},
    {"name": "tags", "type": {"type": "array", "items": "double"}},
    {"name": "who", "aliases": ["user"], "type": ["null", "string"], "default": None},
    {"name": "went", "aliases": ["gone"], "type": ["null", "string"]},   # renamed
    {"name": "added", "type": "string", "default": "x"},    # a default
    {"name": "where", "type": {"type": "record", "name": "Where", "fields": [
        {"name": "lat", "type": "double"}]}, "default": {"lat": 1.5}},
]}


def test_old_versions_resolve_into_the_latest_schema_the_same_way() -> None:
    v1, v2 = _info(1, SchemaType.AVRO, V1), _info(2, SchemaType.AVRO, V2)
    old = [_encode(V1, {"user": f"u{i}", "n": i, "score": i / 4, "kind": "AB"[i % 2],
                        "tags": list(range(i % 3)), "gone": None if i % 2 else "g"})
           for i in range(20)]
    new = [_encode(V2, {"user": f"v{i}", "n": 2**40 + i, "score": 0.1, "kind": "C",
                        "tags": [0.5], "who": None, "went": "w", "added": "y",
                        "where": {"lat": 2.0}})
           for i in range(20)]
    mixed = [v for pair in zip(old, new, strict=True) for v in pair]
    batch = _batch(mixed, [1, 2] * 20)
    for mode in MODES:
        _both(batch, [v1, v2], mode)
    decoder = Decoder([v1, v2])
    out = decode_batch(batch, decoder, "FAILFAST", TOPIC)
    first = out.column("value")[0].as_py()
    assert first == {"user": "u0", "n": 0, "score": 0.0, "kind": "A", "tags": [],
                     "who": None, "went": "g", "added": "x", "where": {"lat": 1.5}}
    # "user" is matched by its name, so "who" (which names it as an alias) takes its default
    assert decoder._columnar[1] is not None and decoder._columnar[2] is not None


def test_values_of_unknown_or_missing_versions_and_other_types_decode_the_same_way() -> None:
    v1 = _info(1, SchemaType.AVRO, V1)
    value = _encode(V1, {"user": "u", "n": 1, "score": 1.0, "kind": "A", "tags": [],
                         "gone": None})
    for versions in ([1, 0], [1, 7]):
        for mode in MODES:
            _both(_batch([value, value], versions), [v1], mode)
    union = {"type": "record", "name": "U", "fields": [
        {"name": "u", "type": ["null", "int", "string"]}]}
    batch = _batch([_encode(union, {"u": 3}), _encode(union, {"u": "s"})], [1, 1])
    _both(batch, [_info(1, SchemaType.AVRO, union)], "FAILFAST")
    for type_ in (SchemaType.STRING, SchemaType.NONE):
        info = SchemaInfo(TOPIC, 1, type_, "", "f", 0)
        for mode in MODES:
            _both(_batch(["é".encode(), b"\xff\xfe", b""], [1, 0, 1]), [info], mode)


# -- JSON -------------------------------------------------------------------------------------

JSON_SCHEMA = {"type": "object", "properties": {
    "user": {"type": "string"}, "n": {"type": "integer"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
    "any": {}, "inner": {"type": "object", "properties": {"a": {"type": "integer"}}}}}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False,
                                                                         allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=6)
documents = st.fixed_dictionaries({}, optional={
    "user": st.text(max_size=8) | json_values, "n": st.integers(-(2**50), 2**50) | json_values,
    "score": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-9, 9),
    "ok": st.booleans(), "tags": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "any": json_values, "inner": st.fixed_dictionaries({}, optional={"a": st.integers(0, 9)}),
    "extra": json_values})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(documents.map(json.dumps) | st.sampled_from(
    ["[1]", "3", "", "{", '{"n": 1}{"n": 2}', '{\n"user": "a"\n}', '{"n": 1.5}', "null",
     '{"user": "\\u00e9"}', '{"n": 1e3}', '{"n": 1},"i":0}\n{"v":{"n": 2}', '{"n": 1}, "x": 2',
     'null\n', '1,"i":0}\nnull\n{"v":1', '{"n": 1, "n": 2}', '{"user": NaN}', '{"ok": 1}',
     '{"score": 99999999999999999999}', '{"inner": {"a": 1, "b": [1, "x"]}}']),
    min_size=1, max_size=8), st.sampled_from(MODES))
def test_json_values_decode_the_same_by_column_and_by_value(docs, mode) -> None:
    info = _info(1, SchemaType.JSON, JSON_SCHEMA)
    _both(_batch([d.encode() for d in docs], [1] * len(docs)), [info], mode)


def test_typical_json_values_take_the_column_path() -> None:
    info = _info(1, SchemaType.JSON, JSON_SCHEMA)
    docs = [json.dumps({"user": f"u{i}", "n": i, "score": i / 3, "ok": i % 2 == 0,
                        "tags": ["a"] * (i % 3), "inner": {"a": i}, "other": [i]})
            for i in range(50)] + ['{\n "user": "pretty",\n "n": 1\n}']
    batch = _batch([d.encode() for d in docs], [1] * len(docs))
    assert Decoder([info]).decode_column(batch.column("value"),
                                         np.ones(len(docs), np.int64)) is not None
    for mode in MODES:
        _both(batch, [info], mode)


def test_a_schema_the_column_decoders_do_not_take_still_decodes() -> None:
    recursive = {"type": "record", "name": "Node", "fields": [
        {"name": "v", "type": "int"}, {"name": "next", "type": ["null", "Node"]}]}
    info = _info(1, SchemaType.AVRO, recursive)
    values = [_encode(recursive, {"v": 1, "next": {"v": 2, "next": None}})]
    decoder = Decoder([info])
    assert decoder.decode_column(pa.array(values, pa.binary()), np.ones(1, np.int64)) is None
    for mode in MODES:
        _both(_batch(values, [1]), [info], mode)


def test_json_values_that_do_not_fit_their_fields_follow_the_mode() -> None:
    # These raised ArrowInvalid out of decode_batch (a traceback, whatever the mode), or
    # failed for a nested object that was merely absent.
    info = _info(1, SchemaType.JSON, JSON_SCHEMA)
    docs = [b'{"n": []}', b'{"score": 99999999999999999999, "user": "a"}', b'{"n": 3}']
    batch = _batch(docs, [1, 1, 1])
    out = decode_batch(batch, Decoder([info]), "PERMISSIVE", TOPIC)
    values = out.column("value").to_pylist()
    assert values[0] is None and out.column("_corrupt_record")[0].as_py() == docs[0]
    assert values[1]["score"] == 1e20 and values[1]["user"] == "a"
    assert values[1]["inner"] is None and values[2]["n"] == 3
    dropped = [0]
    assert decode_batch(batch, Decoder([info]), "DROPMALFORMED", TOPIC, dropped).num_rows == 2
    assert dropped == [1]
    with pytest.raises(ConfigError, match="position 1:0:0"):
        decode_batch(batch, Decoder([info]), "FAILFAST", TOPIC)
