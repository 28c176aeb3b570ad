"""Schema versions, compatibility rules and producers' checks, against a real broker."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tierstream.client import Admin, Producer
from tierstream.errors import ConfigError, NotFoundError
from tierstream.schemas.compat import can_read
from tierstream.schemas.model import SchemaType

from ..logs import running_log
from ..store.helpers import read_all

TOPIC = "acme/shop/orders"

V1 = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "int"},
    {"name": "note", "type": ["null", "string"], "default": None}]}
# v2: a field added with a default, one removed; amount widened int -> long
V2 = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "long"},
    {"name": "currency", "type": "string", "default": "EUR"}]}
# v3: a new field without a default: old data cannot be read with it
V3 = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "long"},
    {"name": "currency", "type": "string", "default": "EUR"},
    {"name": "customer", "type": "string"}]}


def test_versions_fingerprints_and_rules(tmp_path) -> None:
    with running_log(tmp_path / "data") as log, Admin(log.url) as admin:
        admin.create_topic(TOPIC, 2)
        with pytest.raises(NotFoundError, match="has no schema"):
            admin.get_schema(TOPIC)
        one = admin.register_schema(TOPIC, "avro", json.dumps(V1))
        assert one.version == 1 and one.type is SchemaType.AVRO
        # the same schema written differently is the same version
        again = admin.register_schema(TOPIC, "AVRO", json.dumps(V1, indent=4))
        assert again.version == 1 and again.fingerprint == one.fingerprint
        two = admin.register_schema(TOPIC, "avro", json.dumps(V2))
        assert two.version == 2
        assert admin.check_schema(TOPIC, "avro", json.dumps(V3)) is not None
        with pytest.raises(ConfigError, match=r"BACKWARD.*field 'customer' .* no default"):
            admin.register_schema(TOPIC, "avro", json.dumps(V3))
        with pytest.raises(ConfigError, match="change of type"):
            admin.register_schema(TOPIC, "json", json.dumps({"type": "object"}))
        # FORWARD: the old schema must read new data; v3 adds a field: v2 skips it: fine
        admin.set_schema_compatibility(TOPIC, "forward")
        assert admin.check_schema(TOPIC, "avro", json.dumps(V3)) is None
        admin.set_schema_compatibility(TOPIC, "FULL_TRANSITIVE")
        reason = admin.check_schema(TOPIC, "avro", json.dumps(V3))
        assert reason is not None and "FULL_TRANSITIVE" in reason
        admin.set_schema_compatibility(TOPIC, "ALWAYS_INCOMPATIBLE")
        with pytest.raises(ConfigError, match="cannot change"):
            admin.register_schema(TOPIC, "avro", json.dumps(V3))
        admin.set_schema_compatibility(TOPIC, "ALWAYS_COMPATIBLE")
        assert admin.register_schema(TOPIC, "json", json.dumps({"type": "object"})).version == 3
        rule, versions = admin.list_schemas(TOPIC)
        assert rule == "ALWAYS_COMPATIBLE" and [v.version for v in versions] == [1, 2, 3]
        with pytest.raises(ConfigError, match="invalid compatibility 'sideways'"):
            admin.set_schema_compatibility(TOPIC, "sideways")
        with pytest.raises(ConfigError, match="invalid Avro schema"):
            admin.register_schema(TOPIC, "avro", '{"type": "record"}')
        with pytest.raises(ConfigError, match="invalid schema type 'xml'"):
            admin.register_schema(TOPIC, "xml", "<a/>")


@pytest.mark.parametrize(("reader", "writer", "why"), [
    ("int", "long", "changed type from long to int"),
    ("long", "int", None),
    ({"type": "enum", "name": "E", "symbols": ["A"]},
     {"type": "enum", "name": "E", "symbols": ["A", "B"]}, "enum symbol(s) ['B']"),
    (["null", "string"], "string", None),
    ("string", ["null", "string"], "changed type from null to string"),
    ({"type": "array", "items": "double"}, {"type": "array", "items": "float"}, None),
    ({"type": "map", "values": "int"}, {"type": "map", "values": "string"}, "changed type"),
])
def test_avro_resolution_rules(reader, writer, why) -> None:
    got = can_read(SchemaType.AVRO, reader, writer)
    assert (got is None) if why is None else (got is not None and why in got), got


def _rec(name: str, *fields: dict, **extra: object) -> dict:
    return {"type": "record", "name": name, "fields": list(fields), **extra}


_CUR = {"name": "c", "type": {"type": "enum", "name": "Cur", "symbols": ["EUR", "USD"]}}
_HASH = {"name": "h", "type": {"type": "fixed", "name": "Hash", "size": 4}}


@pytest.mark.parametrize(("reader", "writer", "why"), [
    # named types match by unqualified name or a reader's alias (Avro "Schema Resolution")
    (_rec("Order2", {"name": "id", "type": "int"}), _rec("Order", {"name": "id", "type": "int"}),
     "the record 'Order' was renamed to 'Order2' without an alias"),
    (_rec("Order2", {"name": "id", "type": "int"}, aliases=["Order"]),
     _rec("Order", {"name": "id", "type": "int"}), None),
    (_rec("Order2", {"name": "id", "type": "int"}, aliases=["shop.Order"]),
     _rec("Order", {"name": "id", "type": "int"}, namespace="shop"), None),
    (_rec("Order", {"name": "id", "type": "int"}, namespace="b"),
     _rec("Order", {"name": "id", "type": "int"}, namespace="a"), None),
    (_rec("R", {"name": "c", "type": {"type": "enum", "name": "Ccy", "symbols": ["EUR", "USD"]}}),
     _rec("R", _CUR), "the enum 'Cur' was renamed to 'Ccy'"),
    (_rec("R", {"name": "c", "type": {"type": "enum", "name": "Ccy", "aliases": ["Cur"],
                                      "symbols": ["EUR", "USD"]}}), _rec("R", _CUR), None),
    (_rec("R", {"name": "h", "type": {"type": "fixed", "name": "Digest", "size": 4}}),
     _rec("R", _HASH), "the fixed 'Hash' was renamed to 'Digest'"),
    # a writer's field aliases are no names the reader can match
    (_rec("R", {"name": "currency", "type": "string"}),
     _rec("R", {"name": "ccy", "aliases": ["currency"], "type": "string"}),
     "field 'currency' is not in the writer's schema"),
    (_rec("R", {"name": "ccy", "aliases": ["currency"], "type": "string"}),
     _rec("R", {"name": "currency", "type": "string"}), None),
])
def test_avro_named_types_and_aliases(reader, writer, why) -> None:
    """Each verdict agrees with fastavro's own resolution of a value written and read."""
    import io

    import fastavro

    got = can_read(SchemaType.AVRO, reader, writer)
    assert (got is None) if why is None else (got is not None and why in got), got
    parsed = fastavro.parse_schema(writer)
    datum = {"id": 1} if writer["fields"][0]["name"] == "id" else \
        {writer["fields"][0]["name"]: {"c": "EUR", "h": b"abcd"}.get(
            writer["fields"][0]["name"], "x")}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, datum)
    buf.seek(0)
    try:
        fastavro.schemaless_reader(buf, parsed, fastavro.parse_schema(reader))
        readable = True
    except Exception:
        readable = False
    assert readable == (why is None)


def test_an_accepted_rename_reads_every_version_and_a_refused_one_is_never_stored(
        tmp_path) -> None:
    """v1 -> v2 renames field currency to ccy with an alias (accepted), v3 renames it back
    without one (refused: v3 could not read v2's data); a record renamed with an alias is
    accepted and a value_format=auto read decodes every version."""
    import tierstream

    v1 = _rec("Order", {"name": "id", "type": "string"}, {"name": "currency", "type": "string"})
    v2 = _rec("Order", {"name": "id", "type": "string"},
              {"name": "ccy", "aliases": ["currency"], "type": "string"})
    v3 = _rec("Order", {"name": "id", "type": "string"}, {"name": "currency", "type": "string"},
              {"name": "note", "type": ["null", "string"], "default": None})  # not v1 again
    renamed = _rec("Purchase", {"name": "id", "type": "string"},
                   {"name": "ccy", "aliases": ["currency"], "type": "string"})
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1)
        for version, value in ((v1, {"id": "a", "currency": "EUR"}),
                               (v2, {"id": "b", "ccy": "USD"})):
            with Producer(TOPIC, broker=log.url, schema=("avro", json.dumps(version))) as p:
                p.send(value)
        with Admin(log.url) as admin:
            with pytest.raises(ConfigError, match="field 'currency' is not in the writer's"):
                admin.register_schema(TOPIC, "avro", json.dumps(v3))
            with pytest.raises(ConfigError, match="renamed to 'Purchase' without an alias"):
                admin.register_schema(TOPIC, "avro", json.dumps(
                    {**renamed, "name": "Purchase", "aliases": []}))
            assert admin.register_schema(TOPIC, "avro", json.dumps(
                {**renamed, "aliases": ["Order"]})).version == 3
        table = tierstream.read(TOPIC, value_format="auto", **log.kw())
        assert table.column("value").to_pylist() == [{"id": "a", "ccy": "EUR"},
                                                     {"id": "b", "ccy": "USD"}]


def test_json_schema_rules() -> None:
    old = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    new = {"type": "object", "properties": {"a": {"type": "integer"},
                                            "b": {"type": "string"}}, "required": ["a", "b"]}
    assert "field 'b' is required" in (can_read(SchemaType.JSON, new, old) or "")
    assert can_read(SchemaType.JSON, old, new) is None
    typed = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert "changed type" in (can_read(SchemaType.JSON, typed, old) or "")


def test_producers_check_and_encode_values_and_record_the_version(tmp_path) -> None:
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 2)
            admin.create_topic("acme/shop/events", 1)
        with Producer(TOPIC, broker=log.url, schema=("avro", json.dumps(V1))) as producer:
            producer.send_many([{"key": "a", "value": {"id": "o1", "amount": 5, "note": None}}])
            with pytest.raises(ConfigError, match=r"message 1 .*field 'amount'"):
                producer.send_many([{"value": {"id": "o2", "amount": 6, "note": None}},
                                    {"value": {"id": "o3", "amount": "seven", "note": None}}])
        table = read_all(log.url, TOPIC)
        assert table.num_rows == 1  # the bad call sent nothing, not even its good message
        assert dict(table.column("properties")[0].as_py())["tierstream.schema.version"] == "1"
        # a producer without a schema argument uses the topic's latest one
        with Producer(TOPIC, broker=log.url) as producer:
            assert producer.encoder is not None and producer.encoder.info.version == 1
            with pytest.raises(ConfigError, match="is not Avro of it"):
                producer.send(b"\xff\xff raw bytes")
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        with Producer("acme/shop/events", broker=log.url,
                      schema=("json", json.dumps(schema))) as producer:
            producer.send({"n": 1})
            with pytest.raises(ConfigError, match=r"field 'n': 'x' is not of type 'integer'"):
                producer.send({"n": "x"})
        # a topic without a schema takes bytes as before
        with Producer("acme/shop/events", broker=log.url) as producer:
            assert producer.encoder is not None  # it has one now


def test_reads_decode_every_version_into_the_latest_schema(tmp_path) -> None:
    """The evolution test: v1, then v2 (a field added with a default, one removed), part of
    it offloaded; a read across all of it decodes every message to v2; v3 is refused."""
    import tierstream

    with running_log(tmp_path / "data", maxEntriesPerSegment="4") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 2)
        with Producer(TOPIC, broker=log.url, batch_size=5,
                      schema=("avro", json.dumps(V1))) as producer:
            producer.send_many({"key": f"c{i % 3}", "value": {"id": f"a{i}", "amount": i,
                                                              "note": "old"}}
                               for i in range(40))
        log.store.seal(TOPIC)
        moved = log.store.offloader.offload_topic(TOPIC)
        assert moved  # part of v1's data is in the tier now
        with Producer(TOPIC, broker=log.url, batch_size=5,
                      schema=("avro", json.dumps(V2))) as producer:
            producer.send_many({"key": f"c{i % 3}", "value": {"id": f"b{i}", "amount": 2**40 + i,
                                                              "currency": "USD"}}
                               for i in range(30))
        with Admin(log.url) as admin, pytest.raises(ConfigError, match="field 'customer'"):
            admin.register_schema(TOPIC, "avro", json.dumps(V3))
        table = tierstream.read(TOPIC, value_format="auto", **log.kw())
        assert table.num_rows == 70
        assert table.schema.field("value").type == pa.struct([
            ("id", pa.string()), ("amount", pa.int64()), ("currency", pa.string())])
        rows = {r["id"]: r for r in table.column("value").to_pylist()}
        assert rows["a7"] == {"id": "a7", "amount": 7, "currency": "EUR"}  # v1 -> default
        assert rows["b3"]["amount"] == 2**40 + 3 and rows["b3"]["currency"] == "USD"
        raw = tierstream.read(TOPIC, **log.kw())
        assert raw.schema.field("value").type == pa.binary()


def test_undecodable_values_follow_the_mode(tmp_path) -> None:
    import tierstream

    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=log.url) as producer:  # before the schema: bytes
            producer.send(b"legacy bytes")
        with Producer(TOPIC, broker=log.url, schema=("avro", json.dumps(V1))) as producer:
            producer.send({"id": "x", "amount": 1, "note": None})
        with pytest.raises(ConfigError, match=r"cannot decode the value of 'acme/shop/orders' "
                                              r"partition 0 at position \d+:0:0"):
            tierstream.read(TOPIC, value_format="auto", **log.kw())
        loose = tierstream.read(TOPIC, value_format="auto", mode="PERMISSIVE", **log.kw())
        assert loose.column("_corrupt_record").to_pylist() == [b"legacy bytes", None]
        assert loose.column("value").to_pylist()[0] is None
        kept = tierstream.read(TOPIC, value_format="auto", mode="DROPMALFORMED", **log.kw())
        assert kept.column("value").to_pylist() == [{"id": "x", "amount": 1, "note": None}]
        with pytest.raises(ConfigError, match="invalid option 'mode' 'lax': expected FAILFAST"):
            tierstream.read(TOPIC, value_format="auto", mode="lax", **log.kw())


def test_json_values_decode_into_columns(tmp_path) -> None:
    import tierstream

    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "string"}},
                                               "extra": {}}}
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic("acme/shop/events", 1)
        with Producer("acme/shop/events", broker=log.url,
                      schema=("json", json.dumps(schema))) as producer:
            producer.send_many([{"value": {"n": 1, "tags": ["a"], "extra": {"deep": [1]}}},
                                {"value": {"n": 2, "unknown": True}}])
        table = tierstream.read("acme/shop/events", value_format="auto", **log.kw())
        assert table.column("value").to_pylist() == [
            {"n": 1, "tags": ["a"], "extra": '{"deep": [1]}'},  # no type: kept as JSON text
            {"n": 2, "tags": None, "extra": None}]


def test_versions_are_read_from_sliced_batches() -> None:
    # Readers hand out slices of entries; a slice's map keys are its parent's.
    from tierstream.schemas.codec import _versions

    props = pa.array([[("a", "1"), ("tierstream.schema.version", "3")], None,
                      [("tierstream.schema.version", "5")], [],
                      [("tierstream.schema.version", "7")]], pa.map_(pa.string(), pa.string()))
    assert _versions(props).tolist() == [3, 0, 5, 0, 7]
    assert _versions(props.slice(1, 3)).tolist() == [0, 5, 0]
    assert _versions(props.slice(3)).tolist() == [0, 7]


def test_named_versions_are_found_and_a_batch_without_one_names_none() -> None:
    from tierstream.schemas.codec import named_versions

    props = pa.array([[("a", "1"), ("tierstream.schema.version", "3")], None,
                      [("tierstream.schema.version", "5")], []], pa.map_(pa.string(), pa.string()))
    assert named_versions(pa.record_batch({"properties": props})) == {"3", "5"}
    assert named_versions(pa.record_batch({"properties": props.slice(2)})) == {"5"}
    assert named_versions(pa.record_batch({"properties": props.slice(3)})) == set()
    plain = pa.array([[("tierstream.schema.versions", "9")], [("b", "2")]], props.type)
    assert named_versions(pa.record_batch({"properties": plain})) == set()


def test_a_version_newer_than_the_read_says_to_restart() -> None:
    from tierstream.schemas.codec import Decoder, Encoder
    from tierstream.schemas.model import SchemaInfo, canonical

    def info(version: int, schema: dict[str, object]) -> SchemaInfo:
        text, fingerprint = canonical(SchemaType.AVRO, json.dumps(schema))
        return SchemaInfo(TOPIC, version, SchemaType.AVRO, text, fingerprint, 0)

    value = Encoder(info(2, V2)).encode({"id": "x", "amount": 1, "currency": "EUR"})
    with pytest.raises(ValueError, match=r"version 2 is newer than this read knows .*restart"):
        Decoder([info(1, V1)]).decode(value, 2)


def test_transactions_encode_and_check_values_and_the_broker_refuses_forged_versions(
        tmp_path) -> None:
    import tierstream
    from tierstream.client import Transaction

    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 2)
            admin.create_topic("acme/shop/plain", 1)
            admin.register_schema(TOPIC, "avro", json.dumps(V1))
        with Transaction(broker=log.url) as txn:  # dicts are encoded, as a producer's are
            txn.send(TOPIC, {"id": "t1", "amount": 1, "note": None}, key="a")
            txn.write(TOPIC, pa.table({"key": ["b"], "value": pa.array(
                [{"id": "t2", "amount": 2, "note": "x"}])}))
        table = tierstream.read(TOPIC, value_format="auto", **log.kw())
        assert sorted(r["id"] for r in table.column("value").to_pylist()) == ["t1", "t2"]
        assert {dict(p)["tierstream.schema.version"] for p in
                read_all(log.url, TOPIC).column("properties").to_pylist()} == {"1"}
        # a bad value is refused before anything is staged, naming the field
        txn = Transaction(broker=log.url)
        with pytest.raises(ConfigError, match=r"message 0 .*field 'amount'"):
            txn.send(TOPIC, {"id": "t3", "amount": "three", "note": None})
        # raw bytes under a forged version property: checked against the schema, refused
        with pytest.raises(ConfigError, match="is not Avro of it"):
            txn.send(TOPIC, b"\x00garbage", properties={"tierstream.schema.version": "1"})
        txn.abort()
        txn.close()
        # the broker refuses a version the topic does not have, from any writer
        forged = {"tierstream.schema.version": "7"}
        refused = r"'7' names no schema version of topic 'acme/shop/plain' \(it has no schema\)"
        with pytest.raises(ConfigError, match=refused), Transaction(broker=log.url) as txn:
            txn.send("acme/shop/plain", b"raw", properties=forged)
        with Producer("acme/shop/plain", broker=log.url) as producer, \
                pytest.raises(ConfigError, match="names no schema version"):
            producer.send(b"raw", properties=forged)
        assert read_all(log.url, "acme/shop/plain").num_rows == 0
        assert read_all(log.url, TOPIC).num_rows == 2
