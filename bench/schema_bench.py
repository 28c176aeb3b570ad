"""Typed values (issue 16): decoding throughput beside the codec library alone on the same
bytes, and a Spark read with valueFormat=auto beside raw."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import fastavro
import pyarrow as pa

from bench.harness import Figure, console, report, sized, timed
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.schemas.codec import Decoder, Encoder, decode_batch
from tierstream.schemas.model import VERSION_PROPERTY, SchemaInfo, SchemaType, canonical

AVRO = {"type": "record", "name": "Click", "fields": [
    {"name": "user", "type": "string"}, {"name": "page", "type": "string"},
    {"name": "ms", "type": "long"}, {"name": "score", "type": "double"},
    {"name": "tags", "type": {"type": "array", "items": "string"}}]}
JSON_SCHEMA = {"type": "object", "properties": {
    "user": {"type": "string"}, "page": {"type": "string"}, "ms": {"type": "integer"},
    "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def _info(type_: SchemaType, definition: object) -> SchemaInfo:
    text, fingerprint = canonical(type_, json.dumps(definition))
    return SchemaInfo("bench/schema/t", 1, type_, text, fingerprint, 0)


def _batch(values: list[bytes]) -> pa.RecordBatch:
    n = len(values)
    cols = {"key": pa.nulls(n, pa.string()), "key_hash": pa.array([0] * n, pa.int32()),
            "value": pa.array(values, pa.binary()),
            "publish_time": pa.array(range(n), pa.int64()),
            "event_time": pa.nulls(n, pa.int64()),
            "properties": pa.array([[(VERSION_PROPERTY, "1")]] * n,
                                   pa.map_(pa.string(), pa.string())),
            "partition": pa.array([0] * n, pa.int32()),
            "segment_id": pa.array([1] * n, pa.int64()),
            "entry_id": pa.array([0] * n, pa.int64()),
            "batch_index": pa.array(range(n), pa.int32())}
    return pa.RecordBatch.from_pydict(cols, schema=MESSAGE_SCHEMA)


def schema(quick: bool = True) -> Path:
    """Messages/s decoded by ``decode_batch`` (valueFormat=auto) a column at a time, beside
    the value-by-value path it replaced (values to Python, resolved, an Arrow column from
    them) and that beside the codec library alone on the same bytes (fastavro, json.loads);
    then Spark reads with valueFormat=auto beside raw on the same topic, Avro and JSON."""
    n, runs = sized((100_000, 3) if quick else (500_000, 5), (2_000, 1))
    records = [{"user": f"u{i % 500}", "page": f"/p/{i % 70}", "ms": 1_700_000_000_000 + i,
                "score": i / 7, "tags": ["a", "b"] if i % 2 else []} for i in range(n)]
    figures = []
    for type_, definition in ((SchemaType.AVRO, AVRO), (SchemaType.JSON, JSON_SCHEMA)):
        info = _info(type_, definition)
        encoder = Encoder(info)
        values = [encoder.encode(r) for r in records]
        batches = [_batch(values[i:i + 10_000]) for i in range(0, n, 10_000)]

        def ours(vectorised: bool, batches: list[pa.RecordBatch] = batches,
                 info: SchemaInfo = info) -> float:
            decoder = Decoder([info])
            decoder.vectorised = vectorised
            return n / timed(lambda: [decode_batch(b, decoder, "FAILFAST", "t")
                                      for b in batches])

        if type_ is SchemaType.AVRO:
            parsed = fastavro.parse_schema(AVRO)

            def library(values: list[bytes] = values, parsed: object = parsed) -> float:
                return n / timed(lambda: [fastavro.schemaless_reader(io.BytesIO(v), parsed,
                                                                     None) for v in values])
        else:
            def library(values: list[bytes] = values) -> float:
                return n / timed(lambda: [json.loads(v) for v in values])

        lib = "fastavro" if type_ is SchemaType.AVRO else "json.loads"
        column, each, alone = [], [], []
        for _ in range(runs + 1):  # interleaved; the first round warms up
            column.append(ours(True))
            each.append(ours(False))
            alone.append(library())
        figures.append(Figure(f"decode {type_.value} by column (valueFormat=auto)", "msg/s",
                              column[1:], "value by value (before), same batches", each[1:]))
        figures.append(Figure(f"decode {type_.value} value by value", "msg/s", each[1:],
                              f"{lib} alone, same bytes", alone[1:]))
    figures.extend(_spark(quick))
    return report("schema", figures, {"messages": n, "runs": runs})


def _spark(quick: bool) -> list[Figure]:
    from tierstream.broker.process import BrokerProcess
    from tierstream.client import Admin, Producer
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark

    n = sized(100_000 if quick else 500_000, 2_000)
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        broker = BrokerProcess(data).start()
        spark = local_spark("bench-schema")
        register(spark)
        try:
            url = broker.url
            assert url is not None
            for type_, definition in ((SchemaType.AVRO, AVRO), (SchemaType.JSON, JSON_SCHEMA)):
                topic = f"bench/schema/{type_.value.lower()}"
                with Admin(url) as admin:
                    admin.create_topic(topic, 2)
                with Producer(topic, broker=url, batch_size=5000, max_in_flight=16,
                              schema=(type_.value.lower(), json.dumps(definition))
                              ) as producer:
                    producer.send_many({"key": f"u{i % 500}", "value": {
                        "user": f"u{i % 500}", "page": "/p", "ms": i, "score": 0.5,
                        "tags": []}} for i in range(n))

                def count(fmt: str, topic: str = topic) -> float:
                    df = spark.read.format("tierstream").option("topic", topic) \
                        .option("broker", url).option("dataDir", str(data)) \
                        .option("valueFormat", fmt).load()
                    return n / timed(lambda: df.write.format("noop").mode("overwrite").save())

                count("auto")  # warm-up
                auto, raw = [], []
                for _ in range(3):  # interleaved
                    auto.append(count("auto"))
                    raw.append(count("raw"))
                figures.append(Figure(f"Spark read of {type_.value}, valueFormat=auto",
                                      "rows/s", auto, "valueFormat=raw, same topic", raw,
                                      aim=">= 0.7", aim_check=lambda v, r: r is not None
                                      and r >= 0.7))
        finally:
            spark.stop()
            broker.stop()
    console.print(f"Spark: {n:,} messages per topic")
    return figures
