"""Elastic topics on the store: a topic grows at a scale event while producers write, no
message is stored by the old routing after it, and the event is crash-safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pyarrow as pa
import pytest

from tierstream.client import Admin, Producer
from tierstream.errors import UnavailableError
from tierstream.metadata.records import TopicRecord
from tierstream.model.message_format import key_hash
from tierstream.util.faults import ENV

from .. import forkserver
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/web/elastic"


def misrouted(table: pa.Table, record: TopicRecord) -> list[tuple[str, int, int]]:
    """Rows stored in another partition than the routing in force when they were written
    (the count of the last scale event whose first segment is at or below theirs)."""
    bad = []
    for key, partition, segment in zip(*(table.column(c).to_pylist() for c in
                                         ("key", "partition", "segment_id")), strict=True):
        count = record.scale_events[0].old if record.scale_events else record.partitions
        for event in record.scale_events:
            if segment >= event.first_segment_id:
                count = event.new
        if key is not None and key_hash(key) % count != partition:
            bad.append((key, partition, segment))
    return bad


def test_a_topic_grows_twice_under_named_producers_and_nothing_is_misrouted(broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    sent: dict[str, int] = {}
    errors: list[BaseException] = []
    half = threading.Event()

    def write(name: str, count: int) -> None:
        try:
            with Producer(TOPIC, broker=broker.url, name=name, batch_size=5) as producer:
                for i in range(0, count, 25):
                    producer.send_many({"key": f"{name}-k{j % 17}", "value": f"{name}/{j}"}
                                       for j in range(i, i + 25))
                    if i >= count // 2:
                        half.set()
            sent[name] = count
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(f"w{n}", 1500)) for n in range(3)]
    for w in writers:
        w.start()
    with Admin(broker.url) as admin:
        assert half.wait(scaled(60))
        admin.set_partitions(TOPIC, 4)
        record = admin.set_partitions(TOPIC, 8)
    for w in writers:
        w.join(scaled(120))
    assert not errors, errors
    table = read_all(broker.url, TOPIC)
    values = table.column("value").to_pylist()
    assert len(values) == len(set(values)) == 4500  # each message once
    assert [(e.old, e.new) for e in record.scale_events] == [(2, 4), (4, 8)]
    assert not misrouted(table, record)
    assert set(table.column("partition").to_pylist()) == set(range(8))


def test_a_producer_made_before_the_event_follows_it_without_a_restart(broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, name="p") as producer:
        producer.send_many({"key": f"k{i}", "value": b"before"} for i in range(40))
        with Admin(broker.url) as admin:
            admin.set_partitions(TOPIC, 3)
        acks = producer.send_many({"key": f"k{i}", "value": b"after"} for i in range(40))
        assert producer.partitions == 3
        pinned = producer.send_batch(pa.table({"key": ["k0"], "value": [b"pinned"]}),
                                     partition=0)
    assert {a["partition"] for a in acks} == {0, 1, 2}
    assert pinned[0]["partition"] == 0  # a chosen partition is kept
    with Admin(broker.url) as admin:
        record = admin.get_topic(TOPIC)
    table = read_all(broker.url, TOPIC)
    assert table.num_rows == 81
    assert not misrouted(table.filter(pa.compute.not_equal(table["value"], b"pinned")),
                         record)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "tierstream", *args], capture_output=True,
                          text=True, timeout=scaled(120),
                          env={**os.environ, "TIERSTREAM_BROKER": url})


def test_growth_that_the_lineage_cannot_follow_is_refused_in_one_line(broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 4)
    for count, words in [("6", "must be a multiple of 4 (8, 12, ...)"),
                         ("2", "cannot shrink topic 'acme/web/elastic' from 4 to 2"),
                         ("4096", "at most 1024 per topic")]:
        proc = _cli(broker.url, "topic", "set", TOPIC, "--partitions", count)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    same = _cli(broker.url, "topic", "set", TOPIC, "--partitions", "4")
    assert same.returncode == 0 and "already has 4 partitions" in same.stdout
    grown = _cli(broker.url, "topic", "set", TOPIC, "--partitions", "8")
    assert grown.returncode == 0 and "scale event 1: 4 -> 8 partitions" in grown.stdout
    shown = _cli(broker.url, "segments", TOPIC, "--data-dir", "/nonexistent")
    assert "scale event 1: 4 -> 8 partitions (admin): segments" in shown.stdout, shown.stderr
    with Admin(broker.url) as admin:
        assert admin.get_topic(TOPIC).partitions == 8


@pytest.mark.parametrize(("point", "partitions"), [("scale.sealed", 2), ("scale.recorded", 4)])
def test_a_crash_during_a_scale_event_leaves_the_topic_before_or_after_it(
        start_broker, free_port, point: str, partitions: int) -> None:
    broker = start_broker(port=free_port, env={ENV: point})
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=broker.url, name="p", batch_size=7) as producer:
        producer.send_many({"key": f"k{i}", "value": f"a{i}"} for i in range(100))
    with Admin(broker.url) as admin, pytest.raises(UnavailableError):
        admin.set_partitions(TOPIC, 4)
    assert broker.proc is not None
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what=f"the broker to crash at {point}")
    assert broker.proc.returncode == -signal.SIGKILL
    restarted = start_broker(port=free_port)
    with Admin(restarted.url) as admin:
        record = admin.get_topic(TOPIC)
        assert record.partitions == partitions
        if partitions == 2:  # nothing of the event survived: it can be made again
            record = admin.set_partitions(TOPIC, 4)
    with Producer(TOPIC, broker=restarted.url, name="p", batch_size=7) as producer:
        producer.send_many({"key": f"k{i}", "value": f"b{i}"} for i in range(100))
    table = read_all(restarted.url, TOPIC)
    assert sorted(table.column("value").to_pylist()) == sorted(
        [f"a{i}".encode() for i in range(100)] + [f"b{i}".encode() for i in range(100)])
    assert not misrouted(table, record)


def test_a_transaction_staged_before_a_scale_event_commits_by_the_new_routing(broker) -> None:
    from tierstream.client import Transaction

    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    rows = pa.table({"key": [f"k{i % 23}" for i in range(300)],
                     "value": [f"t{i}".encode() for i in range(300)]})
    with Producer(TOPIC, broker=broker.url, name="p") as producer, producer.transaction():
        producer.send_many({"key": f"k{i % 23}", "value": f"p{i}"} for i in range(100))
        with Transaction(broker=broker.url) as txn:
            txn.write(TOPIC, rows)
            with Admin(broker.url) as admin:
                record = admin.set_partitions(TOPIC, 6)  # both are staged, not committed
    table = read_all(broker.url, TOPIC)
    assert sorted(table.column("value").to_pylist()) == sorted(
        [f"t{i}".encode() for i in range(300)] + [f"p{i}".encode() for i in range(100)])
    assert not misrouted(table, record)  # written after the event: routed by 6
    by_key: dict[str, list[bytes]] = {}
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist(),
                          strict=True):
        if value.startswith(b"t"):
            by_key.setdefault(key, []).append(value)
    for values in by_key.values():  # each key's rows of a transaction stay in order
        assert values == sorted(values, key=lambda v: int(v[1:]))


def test_a_busy_topic_grows_by_itself_and_a_quiet_one_does_not(start_broker) -> None:
    broker = start_broker("--no-fsync", "--auto-scale-rate", "100", "--auto-scale-window", "2s")
    busy, quiet = TOPIC, "acme/web/quiet"
    with Admin(broker.url) as admin:
        admin.create_topic(busy, 1)
        admin.create_topic(quiet, 1)
    stop = threading.Event()

    def write(topic: str, per_send: int, pause: float) -> None:
        with Producer(topic, broker=broker.url) as producer:
            while not stop.is_set():
                producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(per_send))
                stop.wait(pause)  # a pacing interval: the quiet topic sends ~5 msg/s

    writers = [threading.Thread(target=write, args=(busy, 200, 0), daemon=True),
               threading.Thread(target=write, args=(quiet, 1, 0.2), daemon=True)]
    for w in writers:
        w.start()
    try:
        with Admin(broker.url) as admin:
            wait_for(lambda: admin.get_topic(busy).partitions >= 2, timeout=scaled(60),
                     what="the busy topic to grow")
            grown, calm = admin.get_topic(busy), admin.get_topic(quiet)
    finally:
        stop.set()
        for w in writers:
            w.join(scaled(30))
    assert calm.partitions == 1 and not calm.scale_events
    event = grown.scale_events[0]
    assert (event.old, event.new) == (1, 2)
    assert event.reason.startswith("auto-scale: every partition above 100 msg/s for 2 seconds")
    shown = _cli(broker.url, "topic", "get", busy)
    assert "scale event 1: 1 -> 2 partitions (auto-scale: every partition" in shown.stdout


def test_a_refusal_a_write_meets_is_the_brokers_answer_not_an_interrupted_call(broker) -> None:
    """A stream the broker refused (its batch routed by an old partition count) fails on the
    next write once the broker has closed it. That error is the broker's answer: the stream
    then says the refusal, and the producer follows the scale event. It was taken for an
    interrupted call (answer unknown): every later call said "interrupted", and a producer
    that met it retried for its send timeout and gave up on a topic that had only grown."""
    import itertools

    import pyarrow.flight as flight

    from tierstream.client.connection import BrokerClient
    from tierstream.client.stream_io import StreamIO
    from tierstream.model.message_format import as_produce_batch
    from tierstream.wire.flight import encode

    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 4)
    client = BrokerClient(broker.url)
    io = StreamIO(client, {"op": "produce", "topic": TOPIC, "partition": 0, "producer": "w",
                           "routed": 1})
    batch = as_produce_batch(pa.record_batch({"key": ["k"], "value": [b"v"]}))
    refused: list[BaseException] = []

    def write_until_refused() -> bool:
        try:
            io.write(batch, pa.py_buffer(encode({"seq": next(seqs)})), scaled(10))
        except flight.FlightError as exc:
            refused.append(exc)
        return bool(refused)

    seqs = itertools.count()
    wait_for(write_until_refused, what="a write to meet the broker's refusal")
    assert "stale_routing" in str(refused[0])
    with pytest.raises(flight.FlightError, match="stale_routing"):
        io.close(scaled(10))  # the stream's answer: the refusal, not "interrupted"
