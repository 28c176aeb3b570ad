"""A bug in a Pulsar connection's worker threads hangs nothing: a fault point
(``faults.py``) raises an error no handler expects in the receipt thread or a consumer's
delivery thread; the thread's owner reports it with its stack and gives its work back, and
the real client goes on without its application noticing."""

from __future__ import annotations

from typing import Any

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.util.faults import FAULT_ENV

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, rows_of


def _with_fault(start_broker: Any, port: int, point: str) -> tuple[BrokerProcess, Any]:
    """A broker whose fault ``point`` is armed, and a real client of it."""
    broker = start_broker("--pulsar-port", str(port), env={FAULT_ENV: point})
    return broker, client_of(broker)


def _reported(broker: BrokerProcess, thread: str) -> bool:
    log = "".join(broker.stderr_tail)
    return f"{thread} stopped by an unexpected error" in log and "InjectedFault" in log


def test_a_receipt_thread_that_fails_drops_the_connection_and_every_send_is_stored_once(
        start_broker, free_port) -> None:
    broker, client = _with_fault(start_broker, free_port, "pulsar.receipt@5")
    topic = "public/default/receipts-fail"
    try:
        producer = client.create_producer(f"persistent://{topic}", producer_name="steady",
                                          batching_enabled=False,
                                          send_timeout_millis=int(scaled(60) * 1000))
        for i in range(20):  # the fifth receipt's thread dies; the client sends it again
            producer.send(f"m{i}".encode())
    finally:
        client.close()
    assert [r["value"] for r in rows_of(broker, topic)] == [f"m{i}".encode()
                                                           for i in range(20)]
    assert _reported(broker, "tierstream-pulsar-receipts")


def test_a_delivery_thread_that_fails_gives_its_messages_back_and_the_consumer_goes_on(
        start_broker, free_port) -> None:
    broker, client = _with_fault(start_broker, free_port, "pulsar.delivery@2")
    topic = "public/default/delivery-fail"
    got: list[bytes] = []
    try:
        consumer = client.subscribe(f"persistent://{topic}", "steady",
                                    consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(f"persistent://{topic}", batching_enabled=False)
        for i in range(30):
            producer.send(f"m{i}".encode())
        while len(set(got)) < 30:  # the second batch's thread dies: delivered again
            msg = consumer.receive(timeout_millis=int(scaled(30) * 1000))
            got.append(msg.data())
            consumer.acknowledge(msg)
        consumer.close()
    finally:
        client.close()
    assert sorted(set(got)) == sorted(f"m{i}".encode() for i in range(30))
    assert _reported(broker, "tierstream-pulsar-consumer")
    with Admin(broker.url) as admin:
        wait_for(lambda: [r["backlog"] for r in admin.subscriptions(topic)] == [0],
                 timeout=scaled(30), what="the backlog to reach 0")
