"""Typed values (issue 16): decoding throughput beside the codec library alone on the same
bytes, and a Spark read with valueFormat=auto beside raw."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import fastavro
import pyarrow as pa

from bench.harness import Figure, console, repeat, report, timed
from tierstream.message_format import MESSAGE_SCHEMA
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
    """Messages/s decoded by ``decode_batch`` (valueFormat=auto: values to Python, resolved,
    into an Arrow struct column) beside the library decoding the same bytes in a loop
    (fastavro.schemaless_reader; json.loads), and a Spark count with valueFormat=auto beside
    raw on the same topic."""
    n, runs = (100_000, 3) if quick else (500_000, 5)
    records = [{"user": f"u{i % 500}", "page": f"/p/{i % 70}", "ms": 1_700_000_000_000 + i,
                "score": i / 7, "tags": ["a", "b"] if i % 2 else []} for i in range(n)]
    figures = []
    for type_, definition in ((SchemaType.AVRO, AVRO), (SchemaType.JSON, JSON_SCHEMA)):
        info = _info(type_, definition)
        encoder = Encoder(info)
        values = [encoder.encode(r) for r in records]
        batches = [_batch(values[i:i + 10_000]) for i in range(0, n, 10_000)]
        decoder = Decoder([info])

        def ours(batches: list[pa.RecordBatch] = batches, decoder: Decoder = decoder) -> float:
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
        figures.append(Figure(f"decode {type_.value} (valueFormat=auto)", "msg/s",
                              repeat(ours, runs), f"{lib} alone, same bytes",
                              repeat(library, runs)))
    figures.append(_spark(quick))
    return report("schema", figures, {"messages": n, "runs": runs})


def _spark(quick: bool) -> Figure:
    from tierstream.broker.process import BrokerProcess
    from tierstream.client import Admin, Producer
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import local_spark

    n = 100_000 if quick else 500_000
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        broker = BrokerProcess(data).start()
        spark = local_spark("bench-schema")
        register(spark)
        try:
            url = broker.url
            assert url is not None
            with Admin(url) as admin:
                admin.create_topic("bench/schema/t", 2)
            with Producer("bench/schema/t", broker=url, schema=("avro", json.dumps(AVRO)),
                          batch_size=5000, max_in_flight=16) as producer:
                producer.send_many({"key": f"u{i % 500}", "value": {
                    "user": f"u{i % 500}", "page": "/p", "ms": i, "score": 0.5,
                    "tags": []}} for i in range(n))

            def count(fmt: str) -> float:
                df = spark.read.format("tierstream").option("topic", "bench/schema/t") \
                    .option("broker", url).option("dataDir", str(data)) \
                    .option("valueFormat", fmt).load()
                return n / timed(lambda: df.write.format("noop").mode("overwrite").save())

            count("auto")  # warm-up
            auto = repeat(lambda: count("auto"), 3, warmup=0)
            raw = repeat(lambda: count("raw"), 3, warmup=0)
        finally:
            spark.stop()
            broker.stop()
    console.print(f"Spark: {n:,} Avro messages")
    return Figure("Spark read, valueFormat=auto (rows/s)", "rows/s", auto,
                  "valueFormat=raw, same topic", raw)
