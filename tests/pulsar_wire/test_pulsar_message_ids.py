"""Pulsar's message ids: a message has one id, the one its send receipt gave, for every
subscription type and for readers; a reader or a seek at a receipt id starts where Pulsar's do.
The oracle is the real pulsar-client (its C++ core numbers a batch's messages itself)."""

from __future__ import annotations

import threading
from typing import Any

import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.model.positions import Position
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.message_ids import cumulative_end, is_own, message_id, positions_of

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

TYPES = {"exclusive": pulsar.ConsumerType.Exclusive, "failover": pulsar.ConsumerType.Failover,
         "shared": pulsar.ConsumerType.Shared, "key_shared": pulsar.ConsumerType.KeyShared}
Id = tuple[int, int, int, int]


def _id(mid: Any) -> Id:
    return mid.ledger_id(), mid.entry_id(), mid.partition(), mid.batch_index()


def _produce(client: Any, topic: str) -> dict[bytes, Id]:
    """Messages sent the three ways a client sends them — in batches (key-based, as Pulsar
    asks of Key_Shared producers), alone without batching, and one at a time with batching
    on (a batch of one) — and each one's receipt id."""
    receipts: dict[bytes, Id] = {}
    lock = threading.Lock()

    def done(value: bytes) -> Any:
        def record(result: Any, mid: Any) -> None:
            assert result == pulsar.Result.Ok, result
            with lock:
                receipts[value] = _id(mid)
        return record

    batched = client.create_producer(topic, batching_enabled=True, batching_max_messages=10,
                                     batching_max_publish_delay_ms=20,
                                     batching_type=pulsar.BatchingType.KeyBased)
    for i in range(120):
        value = f"b{i}".encode()
        batched.send_async(value, done(value), partition_key=f"k{i % 4}")
    batched.flush()
    for i in range(6):  # each sent and waited for: batches of one
        value = f"o{i}".encode()
        receipts[value] = _id(batched.send(value, partition_key=f"k{i % 4}"))
    alone = client.create_producer(topic, batching_enabled=False)
    for i in range(6):
        value = f"a{i}".encode()
        receipts[value] = _id(alone.send(value, partition_key=f"k{i % 4}"))
    return receipts


def _receive_all(consumers: list[Any], total: int) -> dict[bytes, Id]:
    got: dict[bytes, Id] = {}
    lock = threading.Lock()
    stop = threading.Event()
    threading.Timer(scaled(60), stop.set).start()

    def drain(consumer: Any) -> None:
        while not stop.is_set() and len(got) < total:
            try:
                msg = consumer.receive(timeout_millis=int(scaled(0.5) * 1000))
            except pulsar.Timeout:
                continue
            with lock:
                assert msg.data() not in got, f"{msg.data()!r} twice"
                got[msg.data()] = _id(msg.message_id())
            consumer.acknowledge(msg)

    threads = [threading.Thread(target=drain, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    return got


def _backlog(broker: BrokerProcess, topic: str, subscription: str) -> int:
    with Admin(broker.url) as admin:
        return sum(int(r["backlog"]) for r in admin.subscriptions(topic)
                   if r["subscription"] == subscription)


def test_every_subscription_type_sees_the_ids_its_messages_receipts_gave(
        pulsar_broker: BrokerProcess) -> None:
    topic = "public/default/receipts"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 2)
    client = client_of(pulsar_broker)
    try:
        receipts = _produce(client, f"persistent://{topic}")
        assert {mid[3] for mid in receipts.values()} >= {-1, 0, 1}  # alone, batches of 1, more
        for kind, pulsar_type in TYPES.items():
            consumers = [client.subscribe(f"persistent://{topic}", kind,
                                          consumer_type=pulsar_type, consumer_name=f"{kind}-{n}",
                                          initial_position=pulsar.InitialPosition.Earliest)
                         for n in range(1 if kind == "exclusive" else 2)]
            got = _receive_all(consumers, len(receipts))
            for c in consumers:
                c.close()  # sends the acks the client still groups
            wrong = {v: (got.get(v), r) for v, r in receipts.items() if got.get(v) != r}
            assert not wrong, f"{kind}: {len(wrong)} ids differ, e.g. {list(wrong.items())[:3]}"
            # a batch is acknowledged once each of its messages is: nothing is left behind
            wait_for(lambda kind=kind: _backlog(pulsar_broker, topic, kind) == 0,
                     timeout=scaled(30), what=f"{kind}'s backlog to reach 0")
    finally:
        client.close()


@pytest.mark.parametrize("inclusive", [True, False])
def test_a_reader_and_a_seek_at_a_receipt_id_start_where_pulsars_do(
        pulsar_broker: BrokerProcess, inclusive: bool) -> None:
    topic = f"persistent://public/default/from-receipt-{inclusive}"
    client = client_of(pulsar_broker)
    try:
        receipts = _produce(client, topic)
        order = sorted(receipts, key=lambda v: receipts[v][:2] + receipts[v][3:])
        # starts in the middle of a batch, at a batch of one, at a message sent alone
        starts = [v for v in order if receipts[v][3] > 0][4:5] + \
            [v for v in order if v.startswith(b"o")][1:2] + \
            [v for v in order if v.startswith(b"a")][2:3]
        for start in starts:
            at = order.index(start)
            expected = order[at if inclusive else at + 1:][:5]
            reader = client.create_reader(topic, _message_id(receipts[start]),
                                          start_message_id_inclusive=inclusive)
            seen = [reader.read_next(int(scaled(15) * 1000)) for _ in expected]
            reader.close()
            assert [m.data() for m in seen] == expected, start
            assert [_id(m.message_id()) for m in seen] == [receipts[v] for v in expected]
        consumer = client.subscribe(topic, "rewind",
                                    initial_position=pulsar.InitialPosition.Earliest)
        consumer.seek(_message_id(receipts[starts[0]]))  # a seek: what comes after it
        after = consumer.receive(timeout_millis=int(scaled(15) * 1000))
        assert after.data() == order[order.index(starts[0]) + 1]
        consumer.close()
    finally:
        client.close()


def _message_id(mid: Id) -> Any:
    ledger, entry, partition, index = mid
    return pulsar.MessageId(partition, ledger, entry, index)


def test_a_cumulative_ack_of_the_entry_before_a_segments_first_is_no_ack() -> None:
    """Without batch-index acks, a client acknowledges a batch it has not finished
    cumulatively as the entry before it: ``(ledger, -1)`` before a segment's first entry
    (entryId 2^64 - 1 on the wire). That is "nothing of this segment"; read as one of the
    broker's per-message ids (bit 62 is set) it was the whole segment, and a failover or
    exclusive consumer's undelivered messages were acknowledged."""
    before_first = api.MessageIdData(ledgerId=7, entryId=2**64 - 1, partition=-1)
    assert not is_own(before_first)
    assert cumulative_end(before_first, 0) is None
    own = message_id(7, 3, 5, -1)
    assert is_own(own)
    assert cumulative_end(own, 0) == Position(0, 7, 3, 5)
    segment, entry, index = positions_of([own])
    assert (segment.tolist(), entry.tolist(), index.tolist()) == ([7], [3], [5])
