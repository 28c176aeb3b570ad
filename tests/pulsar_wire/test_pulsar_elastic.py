"""A keyed Pulsar producer across a scale event: every key's order kept for tierstream's
readers, though the client learns the new partition count only when it looks again."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pulsar
import pyarrow as pa

from tierstream import read, tail
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.pulsar_protocol import key_router

from ..elastic import Written, check_tailed, order_errors
from .helpers import client_of

TOPIC = "acme/web/pulsar-grows"


def test_a_keyed_pulsar_producer_across_a_scale_event_keeps_each_keys_order(
        pulsar_broker: BrokerProcess) -> None:
    """Before the event every message is stored; after it, the producer (still routing by 2)
    has a message stored where its key still belongs and refused (nothing stored) where the
    key moved; a producer made again routes by 4 and all of its messages are stored. Every
    key's acknowledged messages come back in send order from a read and a tail."""
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    keys = [f"user-{i}" for i in range(24)]
    written = Written(counts=[2, 4])
    outcome: dict[str, str] = {}
    lock = threading.Lock()
    client = client_of(pulsar_broker)

    def send_all(producer: Any, phase: str, n: int) -> None:
        for i in range(n):
            key = keys[i % len(keys)]
            value = f"{key}|{phase}-{i:05d}"

            def done(result: Any, _id: Any, value: str = value) -> None:
                with lock:
                    outcome[value] = str(result)

            producer.send_async(value.encode(), done, partition_key=key)
        with contextlib.suppress(pulsar.ChecksumError):  # flush says a refusal again
            producer.flush()

    try:
        # one message a send: a batch is refused whole if one of its keys moved
        old = client.create_producer(f"persistent://{TOPIC}", batching_enabled=False,
                                     message_router=key_router)
        send_all(old, "a", 600)
        with Admin(pulsar_broker.url) as admin:
            admin.set_partitions(TOPIC, 4)
        send_all(old, "b", 600)  # routed by 2: a moved key is refused
        old.close()
        again = client.create_producer(f"persistent://{TOPIC}", batching_enabled=True,
                                       batching_max_messages=16, message_router=key_router)
        send_all(again, "c", 600)  # routed by 4
        again.close()
    finally:
        client.close()
    assert len(outcome) == 1800
    for value in sorted(outcome, key=lambda v: v.split("|")[1]):  # send order
        if outcome[value] == "Result.Ok":
            written.by_key[value.split("|")[0]].append(value)
    refused = {v for v, r in outcome.items() if r != "Result.Ok"}
    assert {outcome[v] for v in refused} <= {"Result.ChecksumError"}
    assert refused and all("|b-" in v for v in refused)  # only the old producer's, after
    assert any("|b-" in v and outcome[v] == "Result.Ok" for v in outcome)  # not all of it

    for key_ranges in (1, 3):
        table = read(TOPIC, broker=pulsar_broker.url, key_ranges=key_ranges)
        assert order_errors(written, table.column("key").to_pylist(),
                            table.column("value").to_pylist()) == []
    rows: list[pa.RecordBatch] = []
    following = tail(TOPIC, start="earliest", broker=pulsar_broker.url, key_ranges=2)

    def collect() -> None:
        for batch in following:
            rows.append(batch.select(["key", "value"]))

    threading.Thread(target=collect, daemon=True).start()
    check_tailed(written, rows, following)


def test_a_producer_of_a_one_partition_topic_that_grew_keeps_keys_where_they_now_live(
        pulsar_broker: BrokerProcess) -> None:
    """Regression: a producer of a one-partition topic (Pulsar's non-partitioned: it never
    polls the partition count) went on storing every key in partition 0 after the topic grew,
    so a key's later messages sat in the partition it had left."""
    from tierstream.model.message_format import key_hash

    topic = "acme/web/grew-from-one"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 1)
    client = client_of(pulsar_broker)
    outcome: dict[str, str] = {}
    try:
        producer = client.create_producer(f"persistent://{topic}", batching_enabled=False)
        with Admin(pulsar_broker.url) as admin:
            admin.set_partitions(topic, 2)
        for i in range(40):
            key = f"user-{i}"
            try:
                producer.send(key.encode(), partition_key=key)
                outcome[key] = "stored"
            except pulsar.ChecksumError:
                outcome[key] = "refused"
    finally:
        client.close()
    moved = {k for k in outcome if key_hash(k) % 2 == 1}
    assert moved and {outcome[k] for k in moved} == {"refused"}
    assert {outcome[k] for k in set(outcome) - moved} == {"stored"}
    rows = read(topic, broker=pulsar_broker.url)
    assert all(key_hash(k) % 2 == p for k, p in zip(rows.column("key").to_pylist(),
                                                    rows.column("partition").to_pylist(),
                                                    strict=True))
