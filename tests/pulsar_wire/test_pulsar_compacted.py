"""Compacted topics for the real ``pulsar-client``: a reader and an Exclusive consumer with
``is_read_compacted`` get each key's latest message (the snapshot, then the log after its
horizon), a reader under its original id; ``create_table_view`` fills with the latest value per key
and follows updates; Shared and Key_Shared refuse it, as Pulsar's broker does."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pulsar
import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

_topics = itertools.count()


def _topic(broker: BrokerProcess) -> str:
    topic = f"acme/compacted/t{next(_topics)}"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    return topic


def _write(broker: BrokerProcess, topic: str, rng: random.Random, n: int, start: int) -> None:
    rows = [{"key": f"k{rng.randrange(30)}",
             "value": b"" if rng.random() < 0.15 else f"v{i}".encode()}
            for i in range(start, start + n)]
    with Producer(topic, broker=broker.url, batch_size=10) as producer:
        producer.send_many(rows)


def _view(broker: BrokerProcess, topic: str) -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """The fold of the log: each live key's latest value and position."""
    out: dict[str, tuple[bytes, tuple[int, int, int]]] = {}
    for r in tierstream.read(topic, broker=broker.url).to_pylist():
        if r["value"]:
            out[r["key"]] = (r["value"], (r["segment_id"], r["entry_id"], r["batch_index"]))
        else:
            out.pop(r["key"], None)
    return out


def _drain(reader: Any) -> list[Any]:
    got = []
    while reader.has_message_available():
        got.append(reader.read_next(timeout_millis=int(scaled(10_000))))
    return got


def _table(view: Any) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    view.for_each(lambda k, v: out.__setitem__(k, v))
    return out


def _latest(got: list[Any]) -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """What a compacted reader's messages leave per key (a tombstone removes its key)."""
    latest: dict[str, tuple[bytes, tuple[int, int, int]]] = {}
    for msg in got:
        if msg.data():
            latest[msg.partition_key()] = (msg.data(), _id(msg))
        else:
            latest.pop(msg.partition_key(), None)
    return latest


def _read_compacted(broker: BrokerProcess, topic: str, **options: Any) -> list[Any]:
    """Every message a compacted reader from the earliest gets until none is available."""
    client = client_of(broker)
    try:
        reader = client.create_reader(f"persistent://{topic}", pulsar.MessageId.earliest,
                                      is_read_compacted=True, **options)
        got = _drain(reader)
        reader.close()
        return got
    finally:
        client.close()


def _backlog(broker: BrokerProcess, topic: str, subscription: str) -> int:
    with Admin(broker.url) as admin:
        rows = {r["subscription"]: r for r in admin.subscriptions(topic)}
    return int(rows[subscription]["backlog"])


def _id(msg: Any) -> tuple[int, int, int]:
    mid = msg.message_id()
    return (mid.ledger_id(), mid.entry_id(), max(mid.batch_index(), 0))


def test_a_compacted_reader_gets_each_keys_latest_under_its_original_id(
        module_broker: BrokerProcess) -> None:
    rng = random.Random(5)
    topic = _topic(module_broker)
    _write(module_broker, topic, rng, 400, 0)
    with Admin(module_broker.url) as admin:
        assert admin.compact(topic)["status"] == "SUCCESS"
    _write(module_broker, topic, rng, 40, 400)  # after the horizon: read from the log
    got = _read_compacted(module_broker, topic)
    assert _latest(got) == _view(module_broker, topic)
    ids = [_id(m) for m in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # the snapshot's part holds one message per key: far fewer than were written
    assert len(got) < 30 + 40


def test_a_compacted_reader_gets_every_kept_message_of_an_entry_compaction_thinned(
        module_broker: BrokerProcess) -> None:
    # one entry: x0 y1 y2 z3 w4 w5 — compaction keeps batch indexes 0, 2, 3 and 5. A reader
    # acknowledges (cumulatively) each batch's index 0 as it reads it; a second frame of the
    # entry arriving after that was dropped by the client, and y, z and w were lost
    topic = _topic(module_broker)
    with Producer(topic, broker=module_broker.url, batch_size=6) as producer:
        producer.send_many([{"key": k, "value": f"{k}{i}".encode()}
                            for i, k in enumerate("xyyzww")])
    with Admin(module_broker.url) as admin:
        assert admin.compact(topic)["status"] == "SUCCESS"
    got = _read_compacted(module_broker, topic, receiver_queue_size=1)
    assert [(m.partition_key(), m.data(), _id(m)[2]) for m in got] == [
        ("x", b"x0", 0), ("y", b"y2", 2), ("z", b"z3", 3), ("w", b"w5", 5)]


def test_a_table_view_fills_with_the_latest_value_per_key_and_follows(
        module_broker: BrokerProcess) -> None:
    rng = random.Random(9)
    topic = _topic(module_broker)
    _write(module_broker, topic, rng, 300, 0)
    with Admin(module_broker.url) as admin:
        admin.compact(topic)
    client = client_of(module_broker)
    try:
        view = client.create_table_view(f"persistent://{topic}")
        expected = {k: v for k, (v, _) in _view(module_broker, topic).items()}
        assert _table(view) == expected
        _write(module_broker, topic, rng, 50, 300)
        expected = {k: v for k, (v, _) in _view(module_broker, topic).items()}
        wait_for(lambda: _table(view) == expected, timeout=scaled(15),
                 what="the table view to follow the updates (a tombstone removes its key)")
        view.close()
    finally:
        client.close()


@pytest.mark.parametrize("kind", [pulsar.ConsumerType.Shared, pulsar.ConsumerType.KeyShared])
def test_read_compacted_is_refused_on_shared_subscriptions(module_broker: BrokerProcess,
                                                           kind: Any) -> None:
    topic = _topic(module_broker)
    client = client_of(module_broker)
    try:
        with pytest.raises(pulsar.PulsarException):
            client.subscribe(f"persistent://{topic}", "s", consumer_type=kind,
                             is_read_compacted=True)
    finally:
        client.close()


def test_a_compacted_exclusive_consumer_acknowledges_and_resumes(
        module_broker: BrokerProcess) -> None:
    rng = random.Random(11)
    topic = _topic(module_broker)
    _write(module_broker, topic, rng, 300, 0)
    with Admin(module_broker.url) as admin:
        admin.compact(topic)
    expected = _view(module_broker, topic)
    client = client_of(module_broker)
    try:
        consumer = client.subscribe(f"persistent://{topic}", "c", is_read_compacted=True,
                                    initial_position=pulsar.InitialPosition.Earliest)
        got = {}
        for _ in range(len(expected)):
            msg = consumer.receive(timeout_millis=int(scaled(10_000)))
            got[msg.partition_key()] = msg.data()
            consumer.acknowledge(msg)
        # the values; their ids are the broker's own where an entry's part is not its start
        # (a consumer acknowledges a batch only whole: see broker/pulsar/delivered.py)
        assert got == {k: v for k, (v, _) in expected.items()}
        consumer.close()
        consumer = client.subscribe(f"persistent://{topic}", "c", is_read_compacted=True)
        with pytest.raises(pulsar.Timeout):
            consumer.receive(timeout_millis=500)  # everything was acknowledged
        consumer.close()
    finally:
        client.close()
    assert _backlog(module_broker, topic, "c") == 0


def test_a_compacted_exclusive_consumer_acknowledging_cumulatively_gets_every_key(
        module_broker: BrokerProcess) -> None:
    # entries [a0 a1 b2] [c3 c4] [d5]: compaction keeps a1 b2 (not the entry's start), c4, d5
    topic = _topic(module_broker)
    for batch in (["a", "a", "b"], ["c", "c"], ["d"]):
        with Producer(topic, broker=module_broker.url, batch_size=len(batch)) as producer:
            producer.send_many([{"key": k, "value": f"{k}{i}".encode()}
                                for i, k in enumerate(batch)])
    with Admin(module_broker.url) as admin:
        assert admin.compact(topic)["status"] == "SUCCESS"
    client = client_of(module_broker)
    try:
        consumer = client.subscribe(f"persistent://{topic}", "cumulative",
                                    is_read_compacted=True, receiver_queue_size=1,
                                    initial_position=pulsar.InitialPosition.Earliest)
        got = []
        for _ in range(4):
            msg = consumer.receive(timeout_millis=int(scaled(10_000)))
            got.append((msg.partition_key(), msg.data()))
            consumer.acknowledge_cumulative(msg)
        assert got == [("a", b"a1"), ("b", b"b2"), ("c", b"c1"), ("d", b"d0")]
        consumer.close()
    finally:
        client.close()
    assert _backlog(module_broker, topic, "cumulative") == 0


def test_has_message_available_answers_right_when_the_last_message_is_in_the_tier(
        start_broker: Any) -> None:
    from ..ports import fixed_port

    broker = start_broker("--pulsar-port", str(fixed_port()), "--max-entries-per-segment", "5",
                          "--deletion-lag", "0s")
    topic = _topic(broker)
    rng = random.Random(13)
    for n in range(4):  # 4 segments of 5 entries of 10 messages: the open one left empty
        _write(broker, topic, rng, 50, 50 * n)
    with Admin(broker.url) as admin:
        admin.compact(topic)
        assert admin.offload(topic), "nothing offloaded"
        admin.tier_pass()  # and the bookie copies deleted
        open_ = [s for s in admin.list_segments(topic) if s.state == "OPEN"]
        assert all(s.tier_url for s in admin.list_segments(topic) if s.state != "OPEN")
    assert all(s.entries == 0 for s in open_), open_
    got = _read_compacted(broker, topic)
    assert _latest(got) == _view(broker, topic)
