"""What a Pulsar message carries, as tierstream stores it: schemas checked against the topic's
registry, null values, ordering keys, sequence ids and the client's publish time; the real
pulsar-client wheel writes every message."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import _pulsar
import numpy as np
import pulsar
import pyarrow as pa
import pytest
from pulsar.schema import AvroSchema, Integer, JsonSchema, Record, String, StringSchema

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.alike import split_alike
from tierstream.pulsar_protocol.columns import properties_column
from tierstream.pulsar_protocol.frames import command_frame
from tierstream.pulsar_protocol.messages import (
    KEY_BASE64,
    NULL_VALUE,
    ORDERING_KEY,
    PUBLISH_TIME,
    SEQUENCE_ID,
    batch_of,
    plain_batch,
    to_rows,
)
from tierstream.pulsar_protocol.schemas import json_schema_of

from ..timing import scaled
from .helpers import client_of, commands_until, own_properties, rows_of


class Click(Record):
    user = String()
    n = Integer()


def _click_v2() -> type[Record]:
    """Click with a field without a default: a reader of it cannot read old clicks."""

    class Click(Record):
        user = String()
        n = Integer()
        page = String(required=True)

    return Click


class ProtobufSchema(pulsar.schema.Schema):
    """A schema type tierstream does not take (the C++ core announces only STRING, JSON,
    AVRO, PROTOBUF, PROTOBUF_NATIVE and KEY_VALUE schemas to the broker)."""

    def __init__(self) -> None:
        super().__init__(bytes, _pulsar.SchemaType.PROTOBUF, {"type": "record"}, "Proto")

    def encode(self, obj: Any) -> Any:
        return obj

    def decode(self, data: Any) -> Any:
        return data


def _ignore(*_: Any) -> None:
    pass


def _decoded(broker: BrokerProcess, topic: str) -> list[Any]:
    table = tierstream.read(topic, value_format="auto", broker=broker.url)
    return table.column("value").to_pylist()


def test_string_avro_and_json_schemas_register_versions_that_readers_decode(
        pulsar_broker: BrokerProcess) -> None:
    client = client_of(pulsar_broker)
    try:
        for topic, schema, values in [
                ("acme/schemas/text", StringSchema(), ["a", "b"]),
                ("acme/schemas/avro", AvroSchema(Click), [Click(user="u1", n=1)]),
                ("acme/schemas/json", JsonSchema(Click), [Click(user="u2", n=2)])]:
            for _ in range(2):  # the second producer matches the version the first made
                producer = client.create_producer(f"persistent://{topic}", schema=schema)
                for value in values:
                    producer.send(value)
                producer.close()
    finally:
        client.close()
    with Admin(pulsar_broker.url) as admin:
        kinds = {t: [(v.type.value, v.version) for v in admin.list_schemas(t)[1]]
                 for t in ("acme/schemas/text", "acme/schemas/avro", "acme/schemas/json")}
        json_def = admin.get_schema("acme/schemas/json").parsed
    assert kinds == {"acme/schemas/text": [("STRING", 1)], "acme/schemas/avro": [("AVRO", 1)],
                     "acme/schemas/json": [("JSON", 1)]}
    assert json_def == json_schema_of(json.loads(JsonSchema(Click).schema_info().schema()))
    assert _decoded(pulsar_broker, "acme/schemas/text") == ["a", "b", "a", "b"]
    assert _decoded(pulsar_broker, "acme/schemas/avro") == [{"user": "u1", "n": 1}] * 2
    assert _decoded(pulsar_broker, "acme/schemas/json") == [{"user": "u2", "n": 2}] * 2
    rows = rows_of(pulsar_broker, "acme/schemas/avro")
    assert {dict(r["properties"])["tierstream.schema.version"] for r in rows} == {"1"}


def test_an_incompatible_or_unknown_schema_is_refused_and_bytes_still_go(
        pulsar_broker: BrokerProcess) -> None:
    topic = "persistent://acme/schemas/strict"
    client = client_of(pulsar_broker)
    try:
        client.create_producer(topic, schema=AvroSchema(Click)).send(Click(user="u", n=1))
        with pytest.raises(pulsar.IncompatibleSchema):  # BACKWARD: v2 cannot read v1's data
            client.create_producer(topic, schema=AvroSchema(_click_v2()))
        with pytest.raises(pulsar.IncompatibleSchema):
            client.create_producer(topic, schema=ProtobufSchema())
        client.create_producer(topic).send(b"raw")  # bytes, as tierstream's own producers
    finally:
        client.close()
    with Admin(pulsar_broker.url) as admin:
        assert [v.version for v in admin.list_schemas("acme/schemas/strict")[1]] == [1]
    assert [r["value"] for r in rows_of(pulsar_broker, "acme/schemas/strict")][1] == b"raw"
    log = "".join(pulsar_broker.stderr_tail)
    assert "field 'page'" in log or "incompatible schema" in log, log[-2000:]
    assert "PROTOBUF schemas are not supported" in log, log[-2000:]


def test_a_consumer_whose_schema_cannot_read_the_topic_is_refused(
        pulsar_broker: BrokerProcess) -> None:
    """As Pulsar's broker does: a consumer's schema must be one the topic's rule would take
    (BACKWARD here: v2 adds a field without a default, so it cannot read v1's data); the
    same schema, a STRING one on a bytes topic and a BYTES consumer subscribe."""
    topic = "persistent://acme/schemas/consumed"
    client = client_of(pulsar_broker)
    try:
        client.create_producer(topic, schema=AvroSchema(Click)).send(Click(user="u", n=1))
        with pytest.raises(pulsar.IncompatibleSchema):
            client.subscribe(topic, "v2", schema=AvroSchema(_click_v2()))
        with pytest.raises(pulsar.IncompatibleSchema):
            client.subscribe(topic, "proto", schema=ProtobufSchema())
        client.subscribe(topic, "same", schema=AvroSchema(Click))
        client.subscribe(topic, "raw")
        client.subscribe("persistent://acme/schemas/untyped", "s", schema=StringSchema())
    finally:
        client.close()
    with Admin(pulsar_broker.url) as admin:  # a consumer registers nothing
        assert [v.version for v in admin.list_schemas("acme/schemas/consumed")[1]] == [1]
        assert {r["subscription"] for r in admin.subscriptions("acme/schemas/consumed")} == {
            "same", "raw"}
    assert "the consumer's schema cannot read" in "".join(pulsar_broker.stderr_tail)


def test_null_values_ordering_keys_sequence_ids_and_publish_times_are_kept(
        pulsar_broker: BrokerProcess) -> None:
    topic = "persistent://public/default/fields"
    client = client_of(pulsar_broker)
    before = int(time.time() * 1000)
    try:
        for batching in (False, True):
            producer = client.create_producer(topic, batching_enabled=batching,
                                              producer_name=f"fields-{batching}")
            producer.send_async(b"v1", _ignore, partition_key="k1", ordering_key="o1",
                                sequence_id=100)
            tombstone = _pulsar.MessageBuilder().partition_key("k2").sequence_id(101) \
                .set_null_value()
            producer._producer.send_async(tombstone.build(), _ignore)
            producer.send_async(b"v3", _ignore, sequence_id=105)
            producer.flush()
            producer.close()
    finally:
        client.close()
    rows = rows_of(pulsar_broker, "public/default/fields")
    assert len(rows) == 6, "\n".join(str((r["key"], r["value"], r["properties"])) for r in rows)
    for r in rows:
        props = dict(r["properties"])
        assert before <= int(props[PUBLISH_TIME]) <= r["publish_time"] + 5_000
    got = [(r["key"], r["value"], dict(r["properties"]).get(NULL_VALUE),
            dict(r["properties"]).get(ORDERING_KEY), dict(r["properties"])[SEQUENCE_ID],
            own_properties(r)) for r in rows]
    one = [("k1", b"v1", None, "bzE=", "100", {}), ("k2", b"", "true", None, "101", {}),
           (None, b"v3", None, None, "105", {})]
    assert got == one + one  # one producer sends each, the other batches them


def test_an_avro_consumer_decodes_what_tierstream_and_pulsar_producers_wrote(
        pulsar_broker: BrokerProcess) -> None:
    """The consume side of schemas: values written by a tierstream producer and by a Pulsar
    producer under the topic's Avro schema decode in a Pulsar AvroSchema consumer; GET_SCHEMA
    answers the version a message names."""
    from tierstream.client import Producer

    topic = "acme/schemas/clicks"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 1)
    definition = AvroSchema(Click).schema_info().schema()
    with Producer(topic, broker=pulsar_broker.url, schema=("avro", definition)) as ours:
        ours.send({"user": "from-tierstream", "n": 1})
    client = client_of(pulsar_broker)
    try:
        client.create_producer(f"persistent://{topic}", schema=AvroSchema(Click)).send(
            Click(user="from-pulsar", n=2))
        consumer = client.subscribe(f"persistent://{topic}", "decode",
                                    schema=AvroSchema(Click),
                                    initial_position=pulsar.InitialPosition.Earliest)
        got = [consumer.receive(timeout_millis=int(scaled(15) * 1000)) for _ in range(2)]
        assert [(m.value().user, m.value().n) for m in got] == [("from-tierstream", 1),
                                                               ("from-pulsar", 2)]
    finally:
        client.close()
    host, port = pulsar_broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    request = api.BaseCommand(type=api.BaseCommand.GET_SCHEMA, getSchema=api.CommandGetSchema(
        request_id=3, topic=f"persistent://{topic}", schema_version=(1).to_bytes(8, "big")))
    missing = api.BaseCommand(type=api.BaseCommand.GET_SCHEMA, getSchema=api.CommandGetSchema(
        request_id=4, topic="persistent://acme/schemas/none"))
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(command_frame(api.BaseCommand(
            type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
                client_version="t", protocol_version=20))) + command_frame(request)
            + command_frame(missing))
        answers = commands_until(sock, lambda cs: len(cs) == 3)
    found, absent = answers[1].getSchemaResponse, answers[2].getSchemaResponse
    assert (found.request_id, found.schema.type, found.schema_version) == (
        3, api.Schema.Avro, (1).to_bytes(8, "big"))
    assert json.loads(found.schema.schema_data)["name"] == "Click"
    assert (absent.request_id, absent.error_code) == (4, api.TopicNotFound)


def _batch_of(singles: list[tuple[api.SingleMessageMetadata, bytes]]) -> bytes:
    return b"".join(len(m := s.SerializeToString()).to_bytes(4, "big") + m + v
                    for s, v in singles)


@pytest.mark.parametrize("case", ["alike", "ids-cross-128", "ids-cross-1000",
                                  "ids-cross-16384", "ids-cross-128-keyed", "ids-cross-at-1",
                                  "ids-cross-at-59", "sizes-differ", "sizes-step",
                                  "keyed", "keys-differ", "keys-in-base64", "empty",
                                  "event-time", "batch-event-time", "one"])
def test_a_batch_decodes_to_what_was_sent_whichever_path_it_takes(case: str) -> None:
    """Batches of plain messages alike in size are split column-wise (no step per message),
    as are those whose ids cross a varint length (two runs, the second a byte wider); every
    other batch message by message: each comes out as sent."""
    first = {"ids-cross-128": 100, "ids-cross-128-keyed": 100, "ids-cross-1000": 980,
             "ids-cross-16384": 16_350, "ids-cross-at-1": 127, "ids-cross-at-59": 69,
             }.get(case, 5_000)
    count = 1 if case == "one" else 60
    singles = []
    for i in range(count):
        size = 5 + i % 3 if case == "sizes-differ" else 7 + (i >= 30) if case == "sizes-step" \
            else 7
        value = b"v" * size if case != "empty" else b""
        single = api.SingleMessageMetadata(payload_size=len(value), sequence_id=first + i)
        if case in ("keyed", "keys-in-base64", "ids-cross-128-keyed"):
            single.partition_key = f"k{i % 3}é"  # one length: split column-wise
            single.partition_key_b64_encoded = case == "keys-in-base64"
        if case == "keys-differ":
            single.partition_key = f"k{i}"
        if case == "event-time" and i == 7:
            single.event_time = 123
        if case == "empty":
            single.null_value = True
        singles.append((single, value))
    metadata = api.MessageMetadata(producer_name="p", sequence_id=first, publish_time=1,
                                   num_messages_in_batch=count)
    if case == "batch-event-time":
        metadata.event_time = 456
    rows = to_rows(metadata, _batch_of(singles), sequence_id=first).to_pylist()
    assert [r["value"] for r in rows] == [v for _, v in singles]
    assert [dict(r["properties"])[SEQUENCE_ID] for r in rows] == [
        str(first + i) for i in range(count)]
    assert [r["key"] for r in rows] == [s.partition_key or None for s, _ in singles]
    assert [r["event_time"] for r in rows] == [s.event_time or metadata.event_time or None
                                               for s, _ in singles]
    assert all(dict(r["properties"])[PUBLISH_TIME] == "1" for r in rows)
    assert [dict(r["properties"]).get(KEY_BASE64) for r in rows] == [
        "true" if s.partition_key_b64_encoded else None for s, _ in singles]
    column_wise = split_alike(count, _batch_of(singles), 0)
    assert (column_wise is not None) == (case in (
        "alike", "ids-cross-128", "ids-cross-1000", "ids-cross-16384", "ids-cross-128-keyed",
        "ids-cross-at-1", "ids-cross-at-59", "sizes-step", "keyed", "keys-differ",
        "batch-event-time"))


@pytest.mark.parametrize("shape", ["keyed", "unkeyed", "unkeyed-one-size"])
@pytest.mark.parametrize("properties", [None, []], ids=["none", "empty"])
def test_a_batch_the_broker_makes_of_stored_messages_decodes_to_them(properties: Any,
                                                                     shape: str) -> None:
    """Messages without properties (what tierstream's own producer stores) are encoded without
    a step per message in Python; with them (here: empty lists), message by message. Either
    way a client unpacks keys, event times and values as stored, in order."""
    rng = np.random.default_rng(7)
    keyed = shape == "keyed"
    keys = [[None, "a", "bé"][k] if keyed else None for k in rng.integers(0, 3, 300)]
    values = [b"x" * (int(n) if shape != "unkeyed-one-size" else 100)
              for n in rng.integers(0, 9, 300)]
    events = [[None, 5, 1_700_000_000_000][k] if keyed else None
              for k in rng.integers(0, 3, 300)]
    made = batch_of(keys, values, events, [properties] * 300, 1_234)
    assert made is not None
    meta, payload = made
    assert meta.num_messages_in_batch == 300 and meta.publish_time == 1_234
    rows = to_rows(meta, payload, sequence_id=0).to_pylist()
    assert [r["key"] for r in rows] == keys
    assert [r["value"] for r in rows] == values
    assert [r["event_time"] for r in rows] == events


@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("sizes", ["one size", "two sizes", "empty"])
def test_a_plain_batch_from_the_value_column_is_the_bytes_batch_of_makes(start: int,
                                                                         sizes: str) -> None:
    """The broker sends a whole entry of unkeyed messages without properties by
    plain_batch, from the value column's buffers (here a slice of one, as the dispatcher's
    batches are): the same metadata and payload as batch_of's, or None where it cannot."""
    width = {"one size": [100], "two sizes": [100, 7], "empty": [0]}[sizes]
    column = pa.array([b"%03d" % i * (width[i % len(width)] // 3 or 1) if width[0] else b""
                       for i in range(start + 250)], pa.binary())
    values = column.slice(start, 250)
    made = plain_batch(values, 1_234)
    if sizes != "one size":
        assert made is None
        return
    assert made is not None
    expected = batch_of([None] * 250, values.to_pylist(), [None] * 250, [None] * 250, 1_234)
    assert expected is not None
    assert made[0].SerializeToString() == expected[0].SerializeToString()
    assert made[1] == expected[1]
    assert [r["value"] for r in to_rows(made[0], made[1], sequence_id=0).to_pylist()] == \
        values.to_pylist()


@pytest.mark.parametrize("ids", [
    [7], [0, 9, 5], list(range(5_000, 5_060)), list(range(980, 1_040)),
    [3, 2**64 - 1, 40, 0], [], list(range(99_990, 99_999)), [123_456_789, 900_000_001],
    [10**19, 2**64 - 1], [12_345_678, 87_654_321, 10_000_000]])
@pytest.mark.parametrize("shared", [[], [("a", "1795778434497")], [("b", ""), ("c", "xyz")]])
def test_a_properties_column_holds_each_id_then_the_shared_properties(
        ids: list[int], shared: list[tuple[str, str]]) -> None:
    """Built from buffers where every id has as many digits as the others, by takes where
    not: the same map either way, whether the ids come as a list or as an array."""
    for given in (ids, np.array(ids, dtype=np.uint64)):
        column = properties_column(given, "id", shared)
        column.validate(full=True)
        assert column.to_pylist() == [[("id", str(i)), *shared] for i in ids]
