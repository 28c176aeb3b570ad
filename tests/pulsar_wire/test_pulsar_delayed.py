"""Delayed delivery (Pulsar's deliver_at / deliver_after): held from shared and key_shared
consumers until its time, at once for exclusive ones, at its stored position for readers."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pulsar

from tierstream import read
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer
from tierstream.model.message_format import DELIVER_AT
from tierstream.model.positions import Offset

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

TOPIC = "acme/delay/orders"


def _receive(consumer: Any, n: int) -> list[tuple[str, float]]:
    """(value, wall ms when received) of ``n`` messages, acknowledged."""
    out = []
    deadline = time.monotonic() + scaled(60)
    while len(out) < n and time.monotonic() < deadline:
        try:
            msg = consumer.receive(timeout_millis=200)
        except pulsar.Timeout:
            continue
        out.append((msg.data().decode(), time.time() * 1000))
        consumer.acknowledge(msg)
    return out


def test_delayed_messages_wait_for_shared_and_key_shared_consumers_only(
        pulsar_broker: BrokerProcess) -> None:
    """Regression: a send with deliver_after was refused ("delayed delivery ... not
    supported"), which Java's retry-letter topics rely on."""
    delay = scaled(6)
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(pulsar_broker)
    try:
        subs = {kind: client.subscribe(f"persistent://{TOPIC}", kind, consumer_type=t,
                                       initial_position=pulsar.InitialPosition.Earliest)
                for kind, t in (("shared", pulsar.ConsumerType.Shared),
                                ("key_shared", pulsar.ConsumerType.KeyShared),
                                ("exclusive", pulsar.ConsumerType.Exclusive))}
        own = Consumer(TOPIC, "own-shared", mode="shared", broker=pulsar_broker.url,
                       initial=Offset.earliest())
        producer = client.create_producer(f"persistent://{TOPIC}", batching_enabled=False)
        due = time.time() * 1000 + delay * 1000
        for i in range(3):  # the delayed ones first: the log order is later-*, now-*
            producer.send(f"later-{i}".encode(), partition_key=f"k{i}",
                          deliver_after=timedelta(seconds=delay))
        for i in range(3):
            producer.send(f"now-{i}".encode(), partition_key=f"k{i}")
        # exclusive: everything at once, in log order
        got = [v for v, _ in _receive(subs["exclusive"], 6)]
        assert got == [f"later-{i}" for i in range(3)] + [f"now-{i}" for i in range(3)]
        for kind in ("shared", "key_shared"):
            first = [v for v, _ in _receive(subs[kind], 3)]
            assert sorted(first) == [f"now-{i}" for i in range(3)], (kind, first)
        with Admin(pulsar_broker.url) as admin:
            rows = {r["subscription"]: r for r in admin.subscriptions(TOPIC)}
        assert rows["shared"]["delayed"] == 3 and rows["exclusive"]["delayed"] == 0, rows
        for kind in ("shared", "key_shared"):
            later = _receive(subs[kind], 3)
            assert sorted(v for v, _ in later) == [f"later-{i}" for i in range(3)], later
            assert all(at >= due - 50 for _, at in later), (kind, later, due)  # not early
        mine: list[str] = []
        while len(mine) < 6:
            batch = own.receive(timeout=scaled(30))
            assert batch is not None, mine
            mine.extend(v.decode() for v in batch.column("value").to_pylist())
            own.ack(batch)
        assert mine[:3] == [f"now-{i}" for i in range(3)] or time.time() * 1000 >= due, mine
        own.close()
    finally:
        client.close()
    table = read(TOPIC, broker=pulsar_broker.url)  # readers: every message where it is stored
    assert [v.decode() for v in table.column("value").to_pylist()] == \
        [f"later-{i}" for i in range(3)] + [f"now-{i}" for i in range(3)]
    props = [dict(p) for p in table.column("properties").to_pylist()]
    assert all(int(p[DELIVER_AT]) >= due - 1000 for p in props[:3])
    assert all(DELIVER_AT not in p for p in props[3:])


def test_held_messages_survive_a_broker_sigkill(start_broker: Any, free_port: int) -> None:
    delay = scaled(6)
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(broker)
    try:
        consumer = client.subscribe(f"persistent://{TOPIC}", "held",
                                    consumer_type=pulsar.ConsumerType.Shared)
        producer = client.create_producer(f"persistent://{TOPIC}", batching_enabled=False)
        due = time.time() * 1000 + delay * 1000
        for i in range(3):
            producer.send(f"later-{i}".encode(), deliver_after=timedelta(seconds=delay))
        consumer.close()
    finally:
        client.close()
    broker.kill()
    broker = start_broker("--pulsar-port", str(free_port))
    with Consumer(TOPIC, "held", mode="shared", broker=broker.url) as own:
        got: list[tuple[str, float]] = []
        while len(got) < 3:
            batch = own.receive(timeout=scaled(30))
            assert batch is not None, got
            got.extend((v.decode(), time.time() * 1000)
                       for v in batch.column("value").to_pylist())
            own.ack(batch)
    assert sorted(v for v, _ in got) == [f"later-{i}" for i in range(3)]
    assert all(at >= due - 50 for _, at in got), (got, due)
    wait_for(lambda: all(r["delayed"] == 0 for r in Admin(broker.url).subscriptions(TOPIC)),
             timeout=scaled(30), what="nothing held any more")
