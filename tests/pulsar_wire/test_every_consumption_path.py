"""The guard of every consumption path, run the way users run it: each subscription type ×
both clients (the real ``pulsar-client`` and tierstream's ``Consumer``) × one or three
consumers joining one after another × a backlog or a live producer, with one oracle.

The messages are written by tierstream's ``Producer`` in batches of mixed keys (an entry holds
several keys), the case every Key_Shared dispatcher change must keep right. Each consumer
receives on a thread of its own and acknowledges each message as it takes it. The oracle:
every message is received; none twice (no consumer leaves and the broker stays up, so there
is no redelivery to allow for); exclusive and failover keep each partition's order, key_shared
each key's order across its consumers (receipts are stamped in one global order, and an ack
comes after its receipt, so a key that moved too early shows as a key out of order); an
exclusive subscription refuses the consumers after its first; and once the consumers have
closed, nothing is left unacknowledged.

This is the module that must fail first when a dispatcher change breaks a type: keep it small
(its cases share one broker) and under a minute.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import ConflictError
from tierstream.model.positions import Offset

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

TYPES = {"exclusive": pulsar.ConsumerType.Exclusive, "failover": pulsar.ConsumerType.Failover,
         "shared": pulsar.ConsumerType.Shared, "key_shared": pulsar.ConsumerType.KeyShared}
MESSAGES = 600
KEYS = 24
PARTITIONS = 2
#: well under a partition's messages, so that the first consumer holds only part of the
#: backlog when the others join: keys move while messages of them are held
QUEUE = 40
#: each message's work in the application: a consumer's queue is not emptied at once, so a
#: key that moved too early is received by its new owner before its old owner is done
WORK_S = 0.001
_topics = itertools.count()


@dataclass
class Receipts:
    """What every consumer of one case received, in one global order."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (consumer, key, message number, redelivery count) in the order received
    seen: list[tuple[int, str, int, int]] = field(default_factory=list)

    def take(self, consumer: int, key: str, value: bytes, redeliveries: int) -> None:
        with self.lock:
            self.seen.append((consumer, key, int(value), redeliveries))

    def distinct(self) -> int:
        with self.lock:
            return len({i for _, _, i, _ in self.seen})


def _message(i: int) -> dict[str, Any]:
    return {"key": f"k{i % KEYS}", "value": str(i).encode()}


def _produce(broker: BrokerProcess, topic: str, start: int, stop: int) -> None:
    with Producer(topic, broker=broker.url, batch_size=40) as producer:
        for lo in range(start, stop, 50):  # several calls: entries of several keys each
            producer.send_many(_message(i) for i in range(lo, min(lo + 50, stop)))


class _Pulsar:
    """Real-client consumers: one client, a consumer and a receiving thread each."""

    def __init__(self, broker: BrokerProcess, topic: str, kind: str) -> None:
        self.client = client_of(broker)
        self.topic, self.kind = f"persistent://{topic}", kind

    def subscribe(self, n: int) -> Any:
        try:
            return self.client.subscribe(
                self.topic, "guard", consumer_type=TYPES[self.kind], consumer_name=f"c{n}",
                initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=QUEUE)
        except pulsar.ConsumerBusy:
            return None

    @staticmethod
    def receive(consumer: Any, n: int, got: Receipts) -> None:
        try:
            msg = consumer.receive(timeout_millis=100)
        except pulsar.Timeout:
            return
        got.take(n, msg.partition_key(), msg.data(), msg.redelivery_count())
        time.sleep(WORK_S)
        consumer.acknowledge(msg)

    def close(self, consumers: list[Any]) -> None:
        for c in consumers:
            c.close()  # sends the acks it still groups, and waits for them
        self.client.close()


class _Own:
    """tierstream consumers, a receiving thread each."""

    def __init__(self, broker: BrokerProcess, topic: str, kind: str) -> None:
        self.broker, self.topic, self.kind = broker, topic, kind

    def subscribe(self, n: int) -> Consumer | None:
        try:
            return Consumer(self.topic, "guard", mode=self.kind, consumer_name=f"c{n}",
                            initial=Offset.earliest(), receiver_queue_size=QUEUE,
                            broker=self.broker.url)
        except ConflictError:
            return None

    @staticmethod
    def receive(consumer: Consumer, n: int, got: Receipts) -> None:
        batch = consumer.receive(timeout=0.1)
        if batch is None:
            return
        for row in batch.select(["key", "value", "redelivery_count"]).to_pylist():
            got.take(n, row["key"], row["value"], row["redelivery_count"])
            time.sleep(WORK_S)
        consumer.ack(batch)

    def close(self, consumers: list[Consumer]) -> None:
        for c in consumers:
            c.close()


def _check(kind: str, got: Receipts) -> None:
    values = [i for _, _, i, _ in got.seen]
    assert sorted(set(values)) == list(range(MESSAGES)), \
        f"missing {sorted(set(range(MESSAGES)) - set(values))[:20]}"
    twice = sorted(i for i, n in _counts(values).items() if n > 1)
    assert not twice, f"received more than once: {twice[:20]}"
    if kind == "shared":
        return  # no order promised
    by_key: dict[str, list[int]] = defaultdict(list)
    owners: dict[str, set[int]] = defaultdict(set)
    for consumer, key, i, _ in got.seen:
        by_key[key].append(i)
        owners[key].add(consumer)
    for key, seq in by_key.items():
        assert seq == sorted(seq), f"key {key} out of order across consumers " \
                                   f"{sorted(owners[key])}: {seq}"


def _counts(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for v in values:
        out[v] += 1
    return out


@pytest.mark.parametrize("mode", ["backlog", "live"])
@pytest.mark.parametrize("consumers", [1, 3])
@pytest.mark.parametrize("client", ["pulsar", "tierstream"])
@pytest.mark.parametrize("kind", list(TYPES))
def test_every_message_once_and_in_order_on_every_path(
        module_broker: BrokerProcess, kind: str, client: str, consumers: int,
        mode: str) -> None:
    topic = f"acme/guard/{kind}-{client}-{consumers}-{mode}-{next(_topics)}"
    with Admin(module_broker.url) as admin:
        admin.create_topic(topic, PARTITIONS)
    if mode == "backlog":
        _produce(module_broker, topic, 0, MESSAGES)
    side = _Pulsar(module_broker, topic, kind) if client == "pulsar" \
        else _Own(module_broker, topic, kind)
    got, stop = Receipts(), threading.Event()
    attached: list[Any] = []
    threads: list[threading.Thread] = []

    def run(consumer: Any, n: int, receive: Callable[[Any, int, Receipts], None]) -> None:
        while not stop.is_set():
            receive(consumer, n, got)

    producer = threading.Thread(target=_produce, args=(module_broker, topic, 0, MESSAGES),
                                daemon=True)
    try:
        refused = 0
        for n in range(consumers):  # one after another, each receiving as soon as it joined
            if n == 1 and mode == "live":  # the others join while messages arrive
                producer.start()
            consumer = side.subscribe(n)
            if consumer is None:
                refused += 1
                continue
            attached.append(consumer)
            threads.append(threading.Thread(target=run, args=(consumer, n, side.receive),
                                            daemon=True))
            threads[-1].start()
        assert refused == (consumers - 1 if kind == "exclusive" else 0)
        if mode == "live":
            if consumers == 1:
                producer.start()
            producer.join(timeout=scaled(30))
        wait_for(lambda: got.distinct() >= MESSAGES, timeout=scaled(30),
                 what=f"every message ({got.distinct()} of {MESSAGES})")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=scaled(10))
        side.close(attached)
    _check(kind, got)
    with Admin(module_broker.url) as admin:
        left = sum(int(r["backlog"]) for r in admin.subscriptions(topic)
                   if r["subscription"] == "guard")
    assert left == 0, f"{left} message(s) unacknowledged after every consumer closed"
