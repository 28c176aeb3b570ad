"""Several Key_Shared consumers of the real ``pulsar-client`` on one subscription, as
applications run them: each on its own thread, doing a little work per message, on a backlog
of mixed-key batches, of single messages, and on a live producer; joining one after another
and all at once; closing and rejoining halfway; beside tierstream's own consumers; with
batch-index acks, negative acks and cumulative acks.

The rule they all keep (PIP-379): a key is on one consumer at a time, and a key that moves to
a consumer that joined reaches it only once what its old owner was sent of it is acknowledged
(or given back). A consumer that joins therefore waits for the keys it takes over until the
consumer that held them has worked through what it was sent of them — up to its receiver
queue: these tests keep each consumer busy, so that wait is part of every run.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from typing import Any

import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

KEYS = 61
WORK_S = 0.0005  # each message's work in the application
_topics = itertools.count()


class Run:
    """The receipts of one test's consumers, in one global order, and their threads."""

    def __init__(self, broker: BrokerProcess, topic: str) -> None:
        self.broker, self.topic = broker, topic
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str, int, int]] = []  # consumer, key, number, redeliveries
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.client = client_of(broker)

    def take(self, name: str, key: str, value: bytes, redeliveries: int) -> None:
        with self.lock:
            self.seen.append((name, key, int(value), redeliveries))

    def distinct(self) -> int:
        with self.lock:
            return len({i for _, _, i, _ in self.seen})

    def subscribe(self, name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("consumer_type", pulsar.ConsumerType.KeyShared)
        return self.client.subscribe(f"persistent://{self.topic}", "ks", consumer_name=name,
                                     initial_position=pulsar.InitialPosition.Earliest,
                                     **kwargs)

    def receive_on(self, consumer: Any, name: str, *, until: threading.Event | None = None,
                   handle: Any = None, hold: threading.Event | None = None) -> threading.Thread:
        """A thread that receives, works and acknowledges (``handle(msg)`` instead of the
        ack, where given) until the run or ``until`` stops it; given ``hold``, it keeps its
        first message (unacknowledged) until ``hold`` is set."""
        done = until or self.stop

        def run() -> None:
            while not done.is_set() and not self.stop.is_set():
                try:
                    msg = consumer.receive(timeout_millis=100)
                except pulsar.Timeout:
                    continue
                self.take(name, msg.partition_key(), msg.data(), msg.redelivery_count())
                if hold is not None and not hold.wait(scaled(60)):
                    return
                time.sleep(WORK_S)
                if handle is None:
                    consumer.acknowledge(msg)
                else:
                    handle(msg)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def own_on(self, name: str) -> Consumer:
        """A tierstream consumer of the same subscription, on a thread."""
        consumer = Consumer(self.topic, "ks", mode="key_shared", consumer_name=name,
                            initial=Offset.earliest(), broker=self.broker.url)

        def run() -> None:
            while not self.stop.is_set():
                batch = consumer.receive(timeout=0.1)
                if batch is None:
                    continue
                for row in batch.select(["key", "value", "redelivery_count"]).to_pylist():
                    self.take(name, row["key"], row["value"], row["redelivery_count"])
                    time.sleep(WORK_S)
                consumer.ack(batch)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()
        return consumer

    def wait_all(self, total: int) -> None:
        wait_for(lambda: self.distinct() >= total, timeout=scaled(60),
                 what=f"all {total} messages")

    def finish(self, closing: list[Any]) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=scaled(10))
        for c in closing:
            c.close()
        self.client.close()

    def check(self, total: int, *, redelivered_ok: bool = False) -> None:
        """Every message received; none twice unless redelivered (``redelivered_ok``: a
        consumer closed with acks the client had not sent, so its messages went out again);
        each key's first receipts in the order sent, whichever consumers had them."""
        values = [i for _, _, i, _ in self.seen]
        assert set(values) == set(range(total)), \
            f"missing {sorted(set(range(total)) - set(values))[:20]}"
        counts: dict[int, int] = defaultdict(int)
        for v in values:
            counts[v] += 1
        twice = sorted(v for v, n in counts.items() if n > 1)
        if not redelivered_ok:
            assert not twice, f"received more than once: {twice[:20]}"
        firsts: dict[str, list[int]] = defaultdict(list)
        done: set[int] = set()
        for _name, key, i, _ in self.seen:
            if i not in done:
                done.add(i)
                firsts[key].append(i)
        for key, seq in firsts.items():
            assert seq == sorted(seq), f"key {key} out of order: {seq}"

    def backlog(self) -> int:
        with Admin(self.broker.url) as admin:
            return sum(int(r["backlog"]) for r in admin.subscriptions(self.topic)
                       if r["subscription"] == "ks")


def _topic(broker: BrokerProcess, partitions: int) -> str:
    topic = f"acme/ks/t{next(_topics)}"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, partitions)
    return topic


def _write(broker: BrokerProcess, topic: str, total: int, batch: int) -> None:
    """``total`` messages of ``KEYS`` keys, in entries of ``batch`` (mixed keys)."""
    with Producer(topic, broker=broker.url, batch_size=batch) as producer:
        for lo in range(0, total, 200):
            producer.send_many({"key": f"k{i % KEYS}", "value": str(i).encode()}
                               for i in range(lo, min(lo + 200, total)))


@pytest.mark.parametrize(("consumers", "partitions", "data", "joining"), [
    (2, 1, "mixed", "one after another"),
    (3, 1, "mixed", "one after another"),
    (3, 3, "mixed", "all at once"),
    (4, 3, "mixed", "one after another"),
    (2, 3, "single", "one after another"),
    (3, 1, "single", "all at once"),
    (3, 1, "live", "one after another"),
    (4, 3, "live", "all at once"),
])
def test_key_shared_consumers_share_a_backlog_each_key_in_order(
        module_broker: BrokerProcess, consumers: int, partitions: int, data: str,
        joining: str) -> None:
    """Each consumer's queue (200 a partition) holds less than the backlog, and the first to
    join holds its first message until the others are in: so the others join while it has
    messages in flight, and every consumer has a share whatever the timing. (With the default
    queue of 1,000 a partition, the first consumer of a 3-partition backlog of 3,000 may be
    sent all of it before the next one joins — in Pulsar too — and the others get nothing.)"""
    total = 3000
    topic = _topic(module_broker, partitions)
    if data != "live":
        _write(module_broker, topic, total, 100 if data == "mixed" else 1)
    run = Run(module_broker, topic)
    subscribed = []
    everyone_in = threading.Event()
    try:
        if joining == "all at once":
            subscribed = [run.subscribe(f"c{n}", receiver_queue_size=200)
                          for n in range(consumers)]
            for n, c in enumerate(subscribed):
                run.receive_on(c, f"c{n}")
        else:
            for n in range(consumers):
                subscribed.append(run.subscribe(f"c{n}", receiver_queue_size=200))
                run.receive_on(subscribed[-1], f"c{n}", hold=everyone_in)
                if n == 0 and data != "live":
                    wait_for(lambda: run.distinct() > 0, timeout=scaled(30),
                             what="c0's first message")
        everyone_in.set()
        if data == "live":
            _write(module_broker, topic, total, 50)
        run.wait_all(total)
    finally:
        run.finish(subscribed)
    run.check(total)
    assert len({name for name, _, _, _ in run.seen}) > 1, "one consumer received everything"
    wait_for(lambda: run.backlog() == 0, timeout=scaled(15), what="a backlog of 0")


@pytest.mark.parametrize("batch_index_acks", [False, True])
def test_a_key_shared_consumer_that_closes_and_rejoins_halfway_loses_nothing(
        module_broker: BrokerProcess, batch_index_acks: bool) -> None:
    """Without batch-index acks a closing client has not sent the acks of a batch it did not
    finish: those messages come again (counted as redelivered); with them, none does."""
    total = 3000
    topic = _topic(module_broker, 2)
    _write(module_broker, topic, total, 100)
    run = Run(module_broker, topic)
    kwargs = {"batch_index_ack_enabled": batch_index_acks, "receiver_queue_size": 200}
    subscribed = [run.subscribe(f"c{n}", **kwargs) for n in range(3)]
    leaving = threading.Event()
    try:
        run.receive_on(subscribed[0], "c0")
        run.receive_on(subscribed[1], "c1", until=leaving)
        run.receive_on(subscribed[2], "c2")
        wait_for(lambda: run.distinct() >= total // 2, timeout=scaled(60), what="half")
        leaving.set()
        run.threads[1].join(timeout=scaled(10))
        subscribed[1].close()
        subscribed[1] = run.subscribe("c1", **kwargs)  # the same name again
        run.receive_on(subscribed[1], "c1")
        run.wait_all(total)
    finally:
        run.finish(subscribed)
    run.check(total, redelivered_ok=not batch_index_acks)
    wait_for(lambda: run.backlog() == 0, timeout=scaled(15), what="a backlog of 0")


def test_pulsar_and_tierstream_key_shared_consumers_share_one_subscription(
        module_broker: BrokerProcess) -> None:
    total = 3000
    topic = _topic(module_broker, 2)
    _write(module_broker, topic, total, 100)
    run = Run(module_broker, topic)
    subscribed: list[Any] = []
    everyone_in = threading.Event()  # as in the test above: each has a share whatever the timing
    try:
        for n in range(2):
            subscribed.append(run.subscribe(f"p{n}", receiver_queue_size=200))
            run.receive_on(subscribed[-1], f"p{n}", hold=everyone_in)
            if n == 0:
                wait_for(lambda: run.distinct() > 0, timeout=scaled(30), what="p0's first message")
            subscribed.append(run.own_on(f"t{n}"))
        everyone_in.set()
        run.wait_all(total)
    finally:
        run.finish(subscribed)
    run.check(total)
    names = {name[0] for name, _, _, _ in run.seen}
    assert names == {"p", "t"}, f"only {names} received"
    wait_for(lambda: run.backlog() == 0, timeout=scaled(15), what="a backlog of 0")


def test_negative_acks_on_mixed_key_entries_come_again_and_are_acknowledged(
        module_broker: BrokerProcess) -> None:
    """Every 10th message is negatively acknowledged the first time: it comes again (with
    its redelivery count raised), and the backlog still reaches 0."""
    total = 1500
    topic = _topic(module_broker, 2)
    _write(module_broker, topic, total, 100)
    run = Run(module_broker, topic)
    subscribed = [run.subscribe(f"c{n}", negative_ack_redelivery_delay_ms=100)
                  for n in range(3)]

    def handler(consumer: Any) -> Any:
        def handle(msg: Any) -> None:
            if int(msg.data()) % 10 == 0 and msg.redelivery_count() == 0:
                consumer.negative_acknowledge(msg)
            else:
                consumer.acknowledge(msg)
        return handle

    try:
        for n, c in enumerate(subscribed):
            run.receive_on(c, f"c{n}", handle=handler(c))
        run.wait_all(total)
        wait_for(lambda: {i for _, _, i, r in run.seen if r > 0}
                 >= set(range(0, total, 10)), timeout=scaled(30),
                 what="every negatively acknowledged message again")
        # while they receive: a batch a member of which was nacked comes again whole
        wait_for(lambda: run.backlog() == 0, timeout=scaled(30), what="a backlog of 0")
    finally:
        run.finish(subscribed)


@pytest.mark.parametrize("batch_index_acks", [False, True])
@pytest.mark.parametrize("kind", ["exclusive", "failover"])
def test_cumulative_acks_of_mixed_key_batches_acknowledge_everything_before(
        module_broker: BrokerProcess, kind: str, batch_index_acks: bool) -> None:
    """A cumulative ack of the 1,470th message (the 70th of the 15th entry of 100): with
    batch-index acks the 30 after it are left; without, the client acknowledges up to the
    entry before (as Pulsar's clients do), and the whole 15th entry is left."""
    total = 1500
    topic = _topic(module_broker, 1)
    _write(module_broker, topic, total, 100)
    run = Run(module_broker, topic)
    consumer = run.subscribe("c0", consumer_type=getattr(pulsar.ConsumerType, kind.title()),
                             batch_index_ack_enabled=batch_index_acks)
    seen = itertools.count(1)

    def handle(msg: Any) -> None:
        if next(seen) % 70 == 0:
            consumer.acknowledge_cumulative(msg)

    left = 30 if batch_index_acks else 100
    try:
        run.receive_on(consumer, "c0", handle=handle)
        run.wait_all(total)
        run.check(total)
        wait_for(lambda: run.backlog() == left, timeout=scaled(15),
                 what=f"a backlog of {left} (it is {run.backlog()})")
    finally:
        run.finish([consumer])


def test_a_consumers_part_of_a_mixed_key_entry_arrives_as_one_batch(
        module_broker: BrokerProcess) -> None:
    """Two consumers subscribed before a backlog of mixed-key entries of 100 is read: each
    gets its messages of an entry as one batch (a pack, with batch indexes of its own),
    not message by message, and acknowledging them one by one empties the backlog."""
    total = 1000
    topic = _topic(module_broker, 1)
    run = Run(module_broker, topic)
    subscribed = [run.subscribe(f"c{n}") for n in range(2)]
    _write(module_broker, topic, total, 100)
    alone: list[Any] = []
    try:
        deadline = time.monotonic() + scaled(30)
        while run.distinct() < total and time.monotonic() < deadline:
            for n, consumer in enumerate(subscribed):
                try:
                    msg = consumer.receive(timeout_millis=20)
                except pulsar.Timeout:
                    continue
                run.take(f"c{n}", msg.partition_key(), msg.data(), msg.redelivery_count())
                if msg.message_id().batch_index() < 0:
                    alone.append(msg.message_id())
                consumer.acknowledge(msg)
        run.check(total)
        wait_for(lambda: run.backlog() == 0, timeout=scaled(15), what="a backlog of 0")
    finally:
        run.finish(subscribed)
    assert len({name for name, _, _, _ in run.seen}) == 2, "one consumer received everything"
    assert len(alone) < total // 100, f"{len(alone)} messages came alone, not in a batch"
