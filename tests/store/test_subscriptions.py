"""Key_Shared and Exclusive subscriptions with durable cursors, through a real broker."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.broker.subscriptions import CursorMap
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import AlreadyExistsError
from tierstream.splits.positions import KeyRange, Offset, Position

from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/web/clicks"


def _drain(consumer: Consumer, expected: float = float("inf"), timeout: float = 10.0
           ) -> list[pa.RecordBatch]:
    """Batches until ``expected`` messages arrived, or none came for ``timeout`` seconds."""
    got, n = [], 0
    while n < expected:
        batch = consumer.receive(timeout=timeout)
        if batch is None:
            break
        got.append(batch)
        n += batch.num_rows
    return got


def test_key_shared_consumers_with_disjoint_ranges_get_each_message_once(
        broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    ranges = KeyRange.split(3)
    consumers = [Consumer(TOPIC, "ks", mode="key_shared", key_ranges=[r], broker=url,
                          initial=Offset.earliest()) for r in ranges]
    try:
        with Producer(TOPIC, broker=url, batch_size=37) as producer:
            producer.send_many({"value": f"v{i}".encode(), "key": f"user-{i % 97}"}
                               for i in range(6_000))
        owner: dict[str, set[int]] = defaultdict(set)
        values: list[bytes] = []
        for idx, c in enumerate(consumers):
            batches = _drain(c, timeout=scaled(1.0))
            for batch in batches:
                c.ack(batch)
            received = pa.Table.from_batches(batches)
            for row in received.select(["key", "key_hash", "value"]).to_pylist():
                assert ranges[idx].contains(row["key_hash"])
                owner[row["key"]].add(idx)
                values.append(row["value"])
        assert sorted(values) == sorted(f"v{i}".encode() for i in range(6_000))
        assert all(len(o) == 1 for o in owner.values()), "a key went to two consumers"
        # every message acknowledged, each range at its own position: no backlog is left
        # (the lowest range's position alone would count the other ranges' acked messages)
        with Admin(url) as admin:
            assert {(r["partition"], r["backlog"]) for r in admin.subscriptions(TOPIC)} == \
                {(0, 0), (1, 0)}
    finally:
        for c in consumers:
            c.close()


def test_overlapping_key_ranges_and_second_exclusive_consumer_are_refused(
        broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    with Consumer(TOPIC, "ks", mode="key_shared", key_ranges=[KeyRange(0, 1000)], broker=url), \
            pytest.raises(AlreadyExistsError, match="overlap"):
        Consumer(TOPIC, "ks", mode="key_shared", key_ranges=[KeyRange(500, 2000)], broker=url)
    with Consumer(TOPIC, "ex", broker=url), \
            pytest.raises(AlreadyExistsError, match="exclusive consumer"):
        Consumer(TOPIC, "ex", broker=url)


def test_a_consumer_resumes_after_its_last_ack(broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode()} for i in range(100))
    with Consumer(TOPIC, "billing", broker=url, initial=Offset.earliest()) as c:
        batches = _drain(c, 100)
        first = pa.Table.from_batches(batches)
        assert len(first) == 100
        c.ack(Position(0, first.column("segment_id")[44].as_py(),
                       first.column("entry_id")[44].as_py(),
                       first.column("batch_index")[44].as_py()))
    with Consumer(TOPIC, "billing", broker=url) as c:
        rest = pa.Table.from_batches(_drain(c, 55))
    assert rest.column("value").to_pylist() == [f"v{i}".encode() for i in range(45, 100)]


def test_cursor_survives_a_broker_restart(start_broker) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode()} for i in range(30))
    with Consumer(TOPIC, "s", broker=broker.url, initial=Offset.earliest()) as c:
        batch = c.receive(timeout=scaled(10))
        assert batch is not None and batch.num_rows == 10
        c.ack(batch)
    broker.kill()
    restarted = start_broker()
    with Consumer(TOPIC, "s", broker=restarted.url) as c:
        rest = pa.Table.from_batches(_drain(c, 20))
    assert rest.column("value").to_pylist() == [f"v{i}".encode() for i in range(10, 30)]


def test_cursor_map_acks_move_only_the_acked_slots_forward() -> None:
    p = [Position(0, 1, e, 0) for e in range(5)]
    cursor = CursorMap.at(p[0])
    cursor.ack([KeyRange(0, 100)], p[3])
    assert cursor.start_for([KeyRange(0, 50)]) == p[3]
    assert cursor.start_for([KeyRange(50, 200)]) == p[0]
    cursor.ack([KeyRange(0, 100)], p[1])  # never backwards
    assert cursor.start_for([KeyRange(0, 100)]) == p[3]
    cursor.ack([KeyRange(100, 65536)], p[3])
    assert cursor.intervals == [(0, 65536, p[3])]
    assert CursorMap.from_json(cursor.to_json()) == cursor


def test_subscriptions_show_cursor_backlog_and_consumers(broker: BrokerProcess) -> None:
    import json
    import subprocess
    import sys

    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
        with Producer(TOPIC, broker=url, batch_size=50) as producer:
            producer.send_many({"value": f"v{i}".encode(), "key": f"user-{i % 13}"}
                               for i in range(2_000))
        admin.seal(TOPIC)  # a closed segment and a new open one per partition
        with Producer(TOPIC, broker=url, batch_size=50) as producer:
            producer.send_many({"value": f"w{i}".encode(), "key": f"user-{i % 13}"}
                               for i in range(400))
        ends = {p: end for p, (_, end) in admin.last_confirmed(TOPIC).items()}
        counts = {p: admin.advance(TOPIC, Position(p, 0, 0, 0), 10**9, ends[p])[1]
                  for p in ends}
        assert sum(counts.values()) == 2_400
        # what a Spark stream's commit does: partition 0 fully read, partition 1 at a middle
        middle, _ = admin.advance(TOPIC, Position(1, 0, 0, 0), 700, ends[1])
        admin.set_cursor(TOPIC, "spark-job", {0: ends[0], 1: middle})
        consumer = Consumer(TOPIC, "live", mode="key_shared", key_ranges=[KeyRange(0, 30000)],
                            broker=url, initial=Offset.earliest(),
                            consumer_name="reader-a")
        try:
            rows = {(r["subscription"], r["partition"]): r for r in admin.subscriptions(TOPIC)}
            assert rows[("spark-job", 0)]["backlog"] == 0
            assert rows[("spark-job", 0)]["position"] == ends[0]
            assert rows[("spark-job", 1)]["backlog"] == counts[1] - 700
            assert rows[("live", 0)]["backlog"] == counts[0]  # attached, nothing acked
            assert rows[("live", 0)]["consumers"] == ["reader-a"]
            proc = subprocess.run([sys.executable, "-m", "tierstream", "subscriptions", TOPIC,
                                   "--broker", url, "--json"], capture_output=True, text=True,
                                  timeout=scaled(60))
            assert proc.returncode == 0, proc.stderr
            shown = {(r["subscription"], r["partition"]): r for r in json.loads(proc.stdout)}
            assert shown[("spark-job", 1)]["backlog"] == counts[1] - 700
        finally:
            consumer.close()


def test_an_abandoned_subscription_can_be_deleted_but_not_while_attached(
        broker: BrokerProcess) -> None:
    import subprocess
    import sys

    from tierstream.errors import ConflictError, NotFoundError

    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
        with Producer(TOPIC, broker=url) as producer:
            producer.send_many({"value": b"v", "key": f"k{i}"} for i in range(20))
        consumer = Consumer(TOPIC, "old-job", broker=url, initial=Offset.earliest(),
                            consumer_name="still-here")
        try:
            with pytest.raises(ConflictError, match="consumers attached \\(still-here\\)"):
                admin.delete_subscription(TOPIC, "old-job")
        finally:
            consumer.close()
        wait_for(lambda: not any(r["consumers"] for r in admin.subscriptions(TOPIC)),
                 timeout=scaled(10), what="the broker to see the consumer leave")
        proc = subprocess.run([sys.executable, "-m", "tierstream", "subscriptions", TOPIC,
                               "--delete", "old-job", "--broker", url], capture_output=True,
                              text=True, timeout=scaled(60))
        assert proc.returncode == 0, proc.stderr
        assert "deleted subscription 'old-job'" in proc.stdout
        assert admin.subscriptions(TOPIC) == []
        with pytest.raises(NotFoundError, match="no subscription 'old-job'"):
            admin.delete_subscription(TOPIC, "old-job")
        # a consumer of that name starts afresh at its initial position
        with Consumer(TOPIC, "old-job", broker=url, initial=Offset.latest()) as again:
            assert again.receive(timeout=scaled(0.5)) is None
