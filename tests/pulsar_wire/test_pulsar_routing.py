"""Unchanged keyed Pulsar producers: a key is stored where its client routes it (the C++
core's BoostHash by default, a JavaStringHash router, round-robin for unkeyed messages), and
every tierstream reader gets each key's messages in order."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa
import pytest

from tierstream import read, tail
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer
from tierstream.errors import ConfigError
from tierstream.message_format import key_hash
from tierstream.spark_adapter.source import register
from tierstream.splits.positions import Offset

from ..elastic import Written, check_tailed, order_errors
from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

TOPIC = "acme/routed/orders"


def java_string_hash(message: Any, partitions: int) -> int:
    """Java's and Go's default router for a keyed message: String.hashCode, sign-safe mod."""
    h = 0
    for ch in message.partition_key():
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return (h - (1 << 32) if h >= 1 << 31 else h) % partitions


def test_keys_are_stored_where_the_client_routes_them_and_read_in_key_order(
        pulsar_broker: BrokerProcess, spark: Any) -> None:
    """Regression: a keyed producer with the client's default routing got ChecksumError on
    most sends (the broker refused every key not where tierstream's own hash puts it)."""
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(TOPIC, 4)
    written = Written(counts=[4])
    receipts: dict[str, int] = {}
    client = client_of(pulsar_broker)
    try:
        producers = {
            "boost": client.create_producer(f"persistent://{TOPIC}", batching_enabled=True,
                                            batching_max_messages=8),
            "java": client.create_producer(f"persistent://{TOPIC}", batching_enabled=False,
                                           message_router=java_string_hash),
        }
        for name, producer in producers.items():
            keys = [f"{name}-user-{k}" for k in range(12)]
            ids = []
            for i in range(240):
                key = keys[i * 7 % len(keys)]
                value = f"{key}|{i:05d}"
                written.by_key[key].append(value)
                ids.append((value, producer.send_async(value.encode(), None,
                                                       partition_key=key)))
            producer.flush()
        unkeyed = client.create_producer(f"persistent://{TOPIC}", batching_enabled=False)
        for i in range(40):  # round-robin: no key, no order to keep
            receipts[f"rr-{i}"] = unkeyed.send(f"rr-{i}".encode()).partition()
        # the JavaStringHash producer's receipts say where each message went
        for key in [f"java-user-{k}" for k in range(12)]:
            sent = producers["java"].send(f"{key}|99999".encode(), partition_key=key)
            written.by_key[key].append(f"{key}|99999")
            receipts[f"{key}|99999"] = sent.partition()
    finally:
        client.close()
    table = read(TOPIC, broker=pulsar_broker.url)
    assert table.num_rows == 2 * 240 + 40 + 12  # nothing refused
    where = dict(zip([v.decode() for v in table.column("value").to_pylist()],
                     table.column("partition").to_pylist(), strict=True))
    assert all(where[v] == p for v, p in receipts.items())  # where the client put it
    assert len({where[f"rr-{i}"] for i in range(40)}) == 4  # round-robin over all four
    homes = {k: {where[v] for v in vs} for k, vs in written.by_key.items()}
    assert all(len(p) == 1 for p in homes.values())  # each key in one partition
    assert any(key_hash(k) % 4 not in p for k, p in homes.items())  # not tierstream's hash
    assert all(next(iter(homes[f"java-user-{k}"])) == java_string_hash(
        type("M", (), {"partition_key": lambda self, k=k: f"java-user-{k}"})(), 4)
        for k in range(12))
    with Admin(pulsar_broker.url) as admin:
        assert admin.get_topic(TOPIC).key_routing == "client"
        with pytest.raises(ConfigError, match="cannot grow"):
            admin.set_partitions(TOPIC, 8)
        assert admin.get_topic(TOPIC).partitions == 4

    keyed = written  # the round-robin messages have no key: no order to keep, not in it
    for key_ranges in (1, 3):
        rows = read(TOPIC, broker=pulsar_broker.url, key_ranges=key_ranges)
        assert _order(keyed, rows) == [], key_ranges
    batches: list[pa.RecordBatch] = []
    following = tail(TOPIC, start="earliest", broker=pulsar_broker.url, key_ranges=2)

    def collect() -> None:
        for batch in following:
            batches.append(batch.filter(pa.compute.is_valid(batch.column("key")))
                           .select(["key", "value"]))

    threading.Thread(target=collect, daemon=True).start()
    check_tailed(keyed, batches, following)
    _key_shared_in_order(pulsar_broker.url, keyed)
    register(spark)
    df = (spark.read.format("tierstream")
          .options(topic=TOPIC, broker=pulsar_broker.url, partitioning="key-ranges",
                   keyRanges="3").load())
    per_task: dict[str, list[str]] = {}
    for part in df.select("key", "value").rdd.glom().collect():
        for row in part:
            if row.key is not None:
                per_task.setdefault(row.key, []).append(bytes(row.value).decode())
    assert per_task == dict(keyed.by_key)


def _order(written: Written, table: pa.Table) -> list[str]:
    keyed = table.filter(pa.compute.is_valid(table.column("key")))
    return order_errors(written, keyed.column("key").to_pylist(),
                        keyed.column("value").to_pylist())


def _key_shared_in_order(url: str, written: Written) -> None:
    """Two key_shared consumers of tierstream's own: each key's messages in order, once."""
    got: dict[str, list[str]] = {}
    lock = threading.Lock()
    total = written.total
    done = threading.Event()

    def consume(name: str) -> None:
        with Consumer(TOPIC, "in-order", mode="key_shared", consumer_name=name, broker=url,
                      initial=Offset.earliest()) as consumer:
            while not done.is_set():
                batch = consumer.receive(timeout=scaled(0.5))
                if batch is None:
                    continue
                with lock:
                    for key, value in zip(batch.column("key").to_pylist(),
                                          batch.column("value").to_pylist(), strict=True):
                        if key is None:
                            continue
                        got.setdefault(key, []).append(value.decode())
                    if sum(len(v) for v in got.values()) >= total:
                        done.set()
                consumer.ack(batch)

    threads = [threading.Thread(target=consume, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    wait_for(done.is_set, timeout=scaled(60), what="both consumers to get every message")
    for t in threads:
        t.join(scaled(30))
    assert got == dict(written.by_key)
