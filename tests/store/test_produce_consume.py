"""Round trip, ordering, publish-time rules and rollover, through a real broker process."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import pyarrow as pa
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, read
from tierstream.errors import ConfigError
from tierstream.model.positions import Offset
from tierstream.util.timeutil import parse_time_ms

from ..timing import scaled
from .helpers import positions, read_all, wait_for

TOPIC = "acme/web/clicks"


def test_round_trip_keeps_every_field(broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 3)
    sent = [{"value": f"v{i}".encode(), "key": None if i % 7 == 0 else f"k{i % 13}",
             "event_time": 1_000 + i, "properties": {"i": str(i)} if i % 2 else None}
            for i in range(2_500)]
    with Producer(TOPIC, broker=url, batch_size=100) as producer:
        acks = producer.send_many(sent)
    assert sum(a["messages"] for a in acks) == len(sent)
    table = read_all(url, TOPIC)
    got = sorted((r["value"], r["key"], r["event_time"], dict(r["properties"] or []) or None)
                 for r in table.to_pylist())
    want = sorted((m["value"], m["key"], m["event_time"], m["properties"]) for m in sent)
    assert got == want


def test_each_partition_is_read_in_the_order_it_was_written(broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 4)
    with Producer(TOPIC, broker=url, batch_size=50) as producer:
        producer.send_many({"value": str(i).encode(), "key": f"k{i % 31}"} for i in range(5_000))
    table = read_all(url, TOPIC)
    per_key: dict[str, list[int]] = defaultdict(list)
    for row in table.select(["key", "value"]).to_pylist():
        per_key[row["key"]].append(int(row["value"]))
    assert all(v == sorted(v) for v in per_key.values()), "a key's messages came out of order"
    pos = positions(table)
    for p in range(4):
        mine = [x for x in pos if x[0] == p]
        assert mine == sorted(mine) and len(set(mine)) == len(mine)
    # every key lands in exactly one partition (routing by key hash)
    part_of_key: dict[str, set[int]] = defaultdict(set)
    for row in table.select(["key", "partition"]).to_pylist():
        part_of_key[row["key"]].add(row["partition"])
    assert all(len(s) == 1 for s in part_of_key.values())


def test_publish_time_never_decreases_even_when_requested_times_go_backwards(
        broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    base = parse_time_ms("2026-11-01T00:00:00Z")
    requested = [base + 5_000, base + 1_000, base + 9_000, base + 2_000, None, base]
    with Producer(TOPIC, broker=url, batch_size=2) as producer:
        producer.send_many({"value": b"x", "publish_time": t} for t in requested)
    times = read_all(url, TOPIC).column("publish_time").to_pylist()
    assert times[:4] == [base + 5_000, base + 5_000, base + 9_000, base + 9_000]
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert times[4] >= int(time.time() * 1000) - 60_000  # null: the broker's clock


def test_reads_by_time_and_position_are_exact(broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    base = parse_time_ms("2026-11-01T00:00:00Z")
    with Producer(TOPIC, broker=url, batch_size=64) as producer:
        producer.send_many({"value": str(i).encode(), "publish_time": base + i * 10}
                           for i in range(1_000))
    window = list(read(TOPIC, broker=url, start=Offset.at_time(base + 2_505),
                       end=Offset.at_time(base + 3_000)))
    values = [int(v) for b in window for v in b.column("value").to_pylist()]
    assert values == list(range(251, 300))
    # a position in the middle of an entry starts exactly there
    full = read_all(url, TOPIC)
    row = full.slice(100, 1).to_pylist()[0]
    from tierstream.model.positions import Position

    start = Position(0, row["segment_id"], row["entry_id"], row["batch_index"])
    rest = pa.Table.from_batches(list(read(TOPIC, broker=url, start=Offset.at_position(start),
                                           end=Offset.latest())))
    assert rest.column("value").to_pylist() == full.column("value").to_pylist()[100:]


def test_rollover_by_entries(start_broker) -> None:
    url = start_broker("--max-entries-per-segment", "5").url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=url, batch_size=10) as producer:
            producer.send_many({"value": b"x"} for _ in range(120))  # 12 entries
        segs = admin.list_segments(TOPIC)
    assert [s.entries for s in segs] == [5, 5, 2]
    assert [s.state for s in segs] == ["CLOSED", "CLOSED", "OPEN"]
    assert len(read_all(url, TOPIC)) == 120


def test_rollover_by_bytes(start_broker) -> None:
    url = start_broker("--max-segment-bytes", "20KiB").url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=url, batch_size=10) as producer:
            producer.send_many({"value": b"x" * 1000} for _ in range(100))  # ~10 KiB entries
        segs = admin.list_segments(TOPIC)
    closed = [s for s in segs if s.state == "CLOSED"]
    assert len(closed) >= 3
    assert all(s.bytes >= 20 * 1024 and s.entries == 2 for s in closed)
    assert sum(s.messages for s in segs) == 100


def test_rollover_by_age(start_broker) -> None:
    url = start_broker("--segment-rollover-time", "300ms").url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=url) as producer:
            producer.send("first")
            wait_for(lambda: any(s.state == "CLOSED" for s in admin.list_segments(TOPIC)),
                     timeout=scaled(20), what="the aged segment to be sealed")
            producer.send("second")
        segs = admin.list_segments(TOPIC)
    assert segs[0].state == "CLOSED" and segs[0].messages == 1
    assert sum(s.messages for s in segs) == 2


def test_tail_stream_delivers_each_new_message_as_it_is_acknowledged(broker: BrokerProcess
                                                                     ) -> None:
    # Latency is measured by the bench (python -m bench tail), not asserted here.
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    stream = read(TOPIC, broker=url, start=Offset.latest())  # unbounded
    with Producer(TOPIC, broker=url) as producer:
        for i in range(20):
            producer.send(f"m{i}", key="same-key")
            batch = next(stream)  # one message at a time: delivered before the next is sent
            assert batch.column("value").to_pylist() == [f"m{i}".encode()]
    stream.close()


def test_stats_flush_makes_open_segment_visible_in_metadata(broker: BrokerProcess) -> None:
    from tierstream.metadata.store import MetadataStore

    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=url) as producer:
        producer.send_many({"value": b"x"} for _ in range(10))
    meta = MetadataStore(broker.data_dir / "metadata.db", read_only=True)
    try:
        wait_for(lambda: meta.segments(TOPIC)[0].messages == 10, timeout=scaled(10),
                 what="open segment stats in metadata.db")
    finally:
        meta.close()


def test_a_producer_whose_send_was_interrupted_sends_on_without_losing_an_ack(
        broker: BrokerProcess) -> None:
    """Regression: Ctrl-C while ``send_many`` waited for an ack left that read queued on the
    stream's thread; the ack went to it, and the next flush waited ``send_timeout`` for an ack
    the broker had already sent, then gave up."""
    import _thread
    import gc
    import signal
    import threading

    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic("a/b/interrupted", 2)
    messages = [{"key": f"k{i % 17}", "value": f"v{i}".encode(), "sequence_id": i}
                for i in range(60_000)]
    chunks = [messages[i:i + 2_000] for i in range(0, len(messages), 2_000)]
    stop = threading.Event()

    def interrupt_as_they_are_stored() -> None:  # five times, as a user's Ctrl-C would
        thresholds = [6_000, 15_000, 24_000, 33_000, 42_000]
        with Admin(url) as admin:
            while thresholds and not stop.is_set():
                stored = admin.topic_stats("a/b/interrupted")["storage"]["open"]["messages"]
                if stored >= thresholds[0]:
                    thresholds.pop(0)
                    _thread.interrupt_main()
                stop.wait(0.01)

    # interrupt_main() does nothing where SIGINT is ignored (a worker started in the
    # background): Ctrl-C is taken as an interactive program takes it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_as_they_are_stored, daemon=True).start()
    interrupted = 0
    # no cyclic collection meanwhile: an interrupt that lands in a finalizer it runs (once,
    # under load, sqlalchemy's weakref callback) is reported as ignored, never caught here
    gc.disable()
    try:
        with Producer("a/b/interrupted", broker=url, name="importer",
                      batch_size=250) as producer:
            pending = list(chunks)
            while pending:
                try:
                    producer.send_many(pending[0])
                except KeyboardInterrupt:  # the application goes on: it sends it again
                    interrupted += 1
                    continue
                pending.pop(0)
    finally:
        gc.enable()
        stop.set()
        signal.signal(signal.SIGINT, previous)
    assert interrupted == 5
    values = read_all(url, "a/b/interrupted").column("value").to_pylist()
    assert sorted(values) == sorted(m["value"] for m in messages)  # each exactly once


def test_a_message_send_many_cannot_take_is_one_clear_error_and_nothing_is_sent(
        broker: BrokerProcess) -> None:
    """Regression: ``send_many(["text"])`` raised ``TypeError: Message() argument after **
    must be a mapping, not str``; a misspelt field, a TypeError about a keyword."""
    with Admin(broker.url) as admin:
        admin.create_topic("a/b/checked", 1)
    with Producer("a/b/checked", broker=broker.url) as producer:
        for messages, said in [
                ([{"value": "ok"}, "text"], "message 1: expected a Message or a mapping"),
                ([{"value": "ok"}, {"vlaue": "x"}], "message 1: unknown field(s) ['vlaue']"),
                ([{"key": "k"}], "message 0: no 'value' (a message has value, key,")]:
            with pytest.raises(ConfigError) as caught:
                producer.send_many(messages)
            assert said in str(caught.value), str(caught.value)
    assert read_all(broker.url, "a/b/checked").num_rows == 0  # checked before any was sent
