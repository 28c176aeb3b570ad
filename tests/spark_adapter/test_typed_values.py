"""Typed values on Spark: valueFormat=auto derives the columns from the topic's schema at
load() and decodes every version; the sink encodes a struct column by the topic's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tierstream.client import Admin, Producer

from ..logs import running_log
from ..schemas.test_registry import V1, V2
from ..store.helpers import read_all

pytestmark = [pytest.mark.spark]
TOPIC = "acme/shop/orders"


def _evolved(log: Any) -> None:
    """v1 messages (part offloaded), then v2 ones, and one written without a schema."""
    with Admin(log.url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=log.url, batch_size=5) as producer:
        producer.send(b"before any schema")
    with Producer(TOPIC, broker=log.url, batch_size=5,
                  schema=("avro", json.dumps(V1))) as producer:
        producer.send_many({"key": f"c{i % 3}", "value": {"id": f"a{i}", "amount": i,
                                                          "note": None}} for i in range(40))
    log.store.seal(TOPIC)
    assert log.store.offloader.offload_topic(TOPIC)
    with Producer(TOPIC, broker=log.url, batch_size=5,
                  schema=("avro", json.dumps(V2))) as producer:
        producer.send_many({"key": f"c{i % 3}", "value": {"id": f"b{i}", "amount": i,
                                                          "currency": "USD"}} for i in range(30))


def test_a_backfill_decodes_every_version_to_the_latest_schema(spark, tmp_path) -> None:
    from tierstream.spark_adapter import read, register

    register(spark)
    with running_log(tmp_path / "data", maxEntriesPerSegment="4") as log:
        _evolved(log)
        options = {"topic": TOPIC, "broker": log.url, "dataDir": str(log.data_dir),
                   "valueFormat": "auto", "mode": "PERMISSIVE"}
        df = spark.read.format("tierstream").options(**options).load()
        fields = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        assert fields["value"] == "struct<id:string,amount:bigint,currency:string>"
        assert fields["_corrupt_record"] == "binary"
        rows = df.select("value.id", "value.amount", "value.currency",
                         "_corrupt_record").collect()
        assert len(rows) == 71
        by_id = {r["id"]: r for r in rows if r["id"] is not None}
        assert by_id["a3"]["currency"] == "EUR" and by_id["b3"]["currency"] == "USD"
        assert [bytes(r["_corrupt_record"]) for r in rows if r["id"] is None] == \
            [b"before any schema"]
        hybrid = read(spark, **{**options, "mode": "DROPMALFORMED"})
        assert hybrid.count() == 70
        with pytest.raises(Exception, match="cannot decode the value of 'acme/shop/orders'"):
            read(spark, **{**options, "mode": "FAILFAST"}).collect()


def test_the_sink_encodes_a_struct_value_by_the_topics_schema(spark, tmp_path) -> None:
    from tierstream.spark_adapter import register

    register(spark)
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 2)
            admin.register_schema(TOPIC, "avro", json.dumps(V2))
        df = spark.createDataFrame(
            [(f"k{i}", (f"o{i}", i, "EUR")) for i in range(50)],
            "key string, value struct<id:string,amount:bigint,currency:string>")
        df.write.format("tierstream").mode("append").option("topic", TOPIC) \
            .option("broker", log.url).save()
        import tierstream

        table = tierstream.read(TOPIC, value_format="auto", **log.kw())
        assert sorted(v["id"] for v in table.column("value").to_pylist()) == \
            sorted(f"o{i}" for i in range(50))
        bad = spark.createDataFrame([("k", ("o", None, "EUR"))],
                                    "key string, value struct<id:string,amount:bigint,"
                                    "currency:string>")
        with pytest.raises(Exception, match=r"field 'amount'"):
            bad.write.format("tierstream").mode("append").option("topic", TOPIC) \
                .option("broker", log.url).save()
        assert read_all(log.url, TOPIC).num_rows == 50  # the failed write showed nothing


def test_a_decoded_backfill_into_iceberg_has_the_schemas_columns(spark, tmp_path) -> None:
    from pyiceberg.catalog.sql import SqlCatalog

    from tierstream.spark_adapter.jobs import backfill

    with running_log(tmp_path / "data", maxEntriesPerSegment="4") as log:
        _evolved(log)
        out = tmp_path / "orders"
        result = backfill(spark, {"topic": TOPIC, "broker": log.url,
                                  "dataDir": str(log.data_dir), "valueFormat": "auto",
                                  "mode": "DROPMALFORMED"}, str(out), format="iceberg")
        assert result.rows == 70
        table = SqlCatalog("default", uri=f"sqlite:///{out}/catalog.db").load_table(
            result.table)
        values = table.scan().to_arrow().column("value").to_pylist()
        assert sorted(v["id"] for v in values)[:2] == ["a0", "a1"]
        assert {v["currency"] for v in values} == {"EUR", "USD"}
