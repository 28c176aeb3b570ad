"""Unchanged keyed Pulsar producers: a key is stored where its client routes it (the C++
core's BoostHash by default, a JavaStringHash router, round-robin for unkeyed messages), and
every tierstream reader gets each key's messages in order."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pulsar
import pyarrow as pa
import pytest

from tierstream import read, tail
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer
from tierstream.errors import UnavailableError
from tierstream.model.message_format import key_hash
from tierstream.model.positions import Offset
from tierstream.spark_adapter.source import register
from tierstream.util.faults import ENV

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
    # the round-robin messages have no key: no order to keep, not in ``written``
    _every_reader_in_key_order(pulsar_broker.url, written, spark)


def _every_reader_in_key_order(url: str, keyed: Written, spark: Any) -> None:
    """``read`` with one and three key ranges, ``tail``, two key_shared consumers of
    tierstream's own and a Spark read by key ranges each give every key's messages in the
    order they were written."""
    for key_ranges in (1, 3):
        rows = read(TOPIC, broker=url, key_ranges=key_ranges)
        assert _order(keyed, rows) == [], key_ranges
    batches: list[pa.RecordBatch] = []
    following = tail(TOPIC, start="earliest", broker=url, key_ranges=2)

    def collect() -> None:
        for batch in following:
            batches.append(batch.filter(pa.compute.is_valid(batch.column("key")))
                           .select(["key", "value"]))

    threading.Thread(target=collect, daemon=True).start()
    check_tailed(keyed, batches, following)
    _key_shared_in_order(url, keyed)
    register(spark)
    df = (spark.read.format("tierstream")
          .options(topic=TOPIC, broker=url, partitioning="key-ranges",
                   keyRanges="3").load())
    per_task: dict[str, list[str]] = {}
    for part in df.select("key", "value").rdd.glom().collect():
        for row in part:
            if row.key is not None:
                per_task.setdefault(row.key, []).append(bytes(row.value).decode())
    assert per_task == dict(keyed.by_key)


def test_a_client_routed_topic_grows_in_two_steps_and_every_key_stays_in_order(
        start_broker: Any, free_port: int, spark: Any, tmp_path: Path) -> None:
    """Regression: a topic whose keys its Pulsar clients route could not grow. It grows 2 -> 4
    now: announced (clients write to the new partitions at once, a client that has not
    looked again still routes by 2), then recorded after --client-refresh-wait, and every
    reader gives each key's messages in the order written — before the growth, by the old
    client during the announcement, by a client that routes by 4 — Spark streams too."""
    wait_ms = round(scaled(8) * 1000)
    broker = start_broker("--pulsar-port", str(free_port),
                          "--client-refresh-wait", f"{wait_ms}ms")
    url, name = broker.url, f"persistent://{TOPIC}"
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    written = Written(counts=[2, 4])
    keys = {kind: [f"{kind}-user-{k}" for k in range(12)] for kind in ("boost", "java")}

    def producers(client: Any) -> dict[str, Any]:
        return {"boost": client.create_producer(name, batching_enabled=True,
                                                batching_max_messages=8),
                "java": client.create_producer(name, batching_enabled=False,
                                               message_router=java_string_hash),
                "rr": client.create_producer(name, batching_enabled=False)}

    def send(prods: dict[str, Any], phase: str) -> dict[str, int]:
        where: dict[str, int] = {}
        futures = []
        for kind in ("boost", "java"):
            for i in range(96):
                key = keys[kind][i * 7 % 12]
                value = f"{key}|{phase}{i:03d}"
                written.by_key[key].append(value)
                futures.append((value, prods[kind].send(value.encode(), partition_key=key)))
            prods[kind].flush()
        for i in range(8):  # round-robin: no key, no order to keep
            prods["rr"].send(f"rr-{phase}{i}".encode())
        for value, msg_id in futures:
            where[value] = msg_id.partition()
        return where

    old, new = client_of(broker), None
    try:
        stale = producers(old)
        send(stale, "a")
        with Admin(url) as admin:
            assert admin.get_topic(TOPIC).key_routing == "client"
            grown = admin.set_partitions(TOPIC, 4)
            assert (grown.partitions, grown.announced) == (2, 4)
        stale_where = send(stale, "b")  # the old client still routes by 2
        assert set(stale_where.values()) == {0, 1}
        new = client_of(broker)
        assert len(new.get_topic_partitions(name)) == 4
        got: dict[str, list[str]] = {}
        consumer = new.subscribe(name, "pulsar-ks", consumer_type=pulsar.ConsumerType.KeyShared,
                                 initial_position=pulsar.InitialPosition.Earliest)
        fresh_where = send(producers(new), "c")
        assert {2, 3} <= set(fresh_where.values())  # keys moved to the new partitions
        # announced, not recorded: tierstream's readers see the old partitions only
        early = read(TOPIC, broker=url)
        assert set(early.column("partition").to_pylist()) == {0, 1}
        seen = {v.decode() for v in early.column("value").to_pylist()}
        assert {v for v, p in fresh_where.items() if p < 2} | set(stale_where) <= seen
        with Admin(url) as admin:
            wait_for(lambda: admin.get_topic(TOPIC).partitions == 4, timeout=scaled(60),
                     what="the announced growth to be recorded")
            event = admin.get_topic(TOPIC).scale_events[-1]
            assert (event.old, event.new, admin.get_topic(TOPIC).announced) == (2, 4, None)
        # the Pulsar consumer subscribed during the announcement: the new partitions'
        # messages come after their parents' from before the event were acknowledged
        deadline = scaled(60)
        until = time.monotonic() + deadline
        while sum(len(v) for v in got.values()) < written.total and time.monotonic() < until:
            try:
                msg = consumer.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            if msg.partition_key():
                got.setdefault(msg.partition_key(), []).append(msg.data().decode())
            consumer.acknowledge(msg)
        assert got == dict(written.by_key)
    finally:
        old.close()
        if new is not None:
            new.close()
    table = read(TOPIC, broker=url)
    assert table.num_rows == 3 * (2 * 96 + 8)  # nothing refused, nothing twice
    where = dict(zip([v.decode() for v in table.column("value").to_pylist()],
                     table.column("partition").to_pylist(), strict=True))
    assert all(where[v] == p for v, p in {**stale_where, **fresh_where}.items())
    _every_reader_in_key_order(url, written, spark)
    _a_stream_in_key_order(url, written, spark, tmp_path)


def _a_stream_in_key_order(url: str, written: Written, spark: Any, tmp_path: Path) -> None:
    """A Structured Streaming read (key-ranges, 101 messages a trigger) across the event:
    each key in one Spark partition per micro-batch, in the order written."""
    from pyspark.sql import functions as F

    seen: list[Any] = []

    def keep(df: Any, batch_id: int) -> None:
        seen.extend(df.select("key", "value", F.lit(batch_id).alias("batch"),
                              F.spark_partition_id().alias("pid"),
                              F.monotonically_increasing_id().alias("idx")).collect())

    query = (spark.readStream.format("tierstream")
             .options(topic=TOPIC, broker=url, startingPosition="earliest",
                      maxRecordsPerTrigger="101", keyRanges="2").load()
             .writeStream.foreachBatch(keep)
             .option("checkpointLocation", str(tmp_path / "stream-checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    assert query.exception() is None
    keyed = [r for r in sorted(seen, key=lambda r: (r.batch, r.idx)) if r.key is not None]
    places: dict[tuple[str, int], set[int]] = {}
    for r in keyed:
        places.setdefault((r.key, r.batch), set()).add(r.pid)
    assert all(len(pids) == 1 for pids in places.values())
    assert len({r.batch for r in keyed}) > 1  # the event lies inside the stream's batches
    assert order_errors(written, [r.key for r in keyed],
                        [bytes(r.value) for r in keyed]) == []


def test_a_broker_killed_after_announcing_a_growth_records_it_after_the_restart(
        start_broker: Any, free_port: int) -> None:
    """The announcement is in the metadata: a broker SIGKILLed right after it opens the new
    partitions when it starts again, and records the event when the wait is over."""
    broker = start_broker("--pulsar-port", str(free_port), env={ENV: "scale.announced"})
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    written = Written(counts=[2, 4])

    def send(phase: str) -> None:
        client = client_of(started)
        try:
            producer = client.create_producer(f"persistent://{TOPIC}", batching_enabled=False)
            for i in range(48):
                key = f"user-{i % 12}"
                written.by_key[key].append(f"{key}|{phase}{i:03d}")
                producer.send(f"{key}|{phase}{i:03d}".encode(), partition_key=key)
        finally:
            client.close()

    started = broker
    send("a")
    with Admin(broker.url) as admin, pytest.raises(UnavailableError):
        admin.set_partitions(TOPIC, 4)
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what="the broker to crash at scale.announced")
    assert broker.proc is not None and broker.proc.returncode == -signal.SIGKILL
    started = start_broker("--pulsar-port", str(free_port), "--client-refresh-wait",
                           f"{round(scaled(10) * 1000)}ms")
    with Admin(started.url) as admin:
        assert 4 in (admin.get_topic(TOPIC).announced, admin.get_topic(TOPIC).partitions)
        send("b")  # a new client routes by 4: to the new partitions too
        wait_for(lambda: admin.get_topic(TOPIC).partitions == 4, timeout=scaled(60),
                 what="the announced growth to be recorded")
    table = read(TOPIC, broker=started.url)
    assert set(table.column("partition").to_pylist()) & {2, 3}  # written after the restart
    assert _order(written, table) == [] and table.num_rows == written.total


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
