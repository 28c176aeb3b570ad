"""The real pulsar-client as a Pulsar application runs it, beside tierstream's own clients in
the fault runs: a named producer and a key_shared consumer, each given a multi-host service
URL, on a topic of their own (``PULSAR_TOPIC``)."""

from __future__ import annotations

import contextlib
import threading

import pulsar

from ..timing import scaled
from .helpers import wait_for
from .test_network_bookies import KEYS, check_exactly_once_in_order

PULSAR_TOPIC = "acme/net/payments"


class PulsarTraffic:
    """A named producer sending ``k<i % 7>:<i>`` with that key (the client routes it by the
    key's hash, as Pulsar's does), synchronously so a send that returns was acknowledged, and
    a key_shared consumer receiving and acknowledging, each on a thread of its own."""

    def __init__(self, service_url: str, token: str, *, send_timeout: float) -> None:
        self.acked = 0
        self.values: list[str] = []
        self.errors: list[BaseException] = []
        self._stop, self._stop_consumer = threading.Event(), threading.Event()
        self._client = pulsar.Client(
            service_url, authentication=pulsar.AuthenticationToken(token),
            operation_timeout_seconds=int(scaled(15)),
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        name = f"persistent://{PULSAR_TOPIC}"
        self._consumer = self._client.subscribe(
            name, "audit", consumer_type=pulsar.ConsumerType.KeyShared,
            initial_position=pulsar.InitialPosition.Earliest)
        self._producer = self._client.create_producer(
            name, producer_name="pulsar-writer", batching_enabled=False,
            send_timeout_millis=int(send_timeout * 1000))
        self._threads = [threading.Thread(target=self._send, daemon=True),
                         threading.Thread(target=self._receive, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _send(self) -> None:
        try:
            i = 0
            while not self._stop.is_set():
                key = f"k{i % KEYS}"
                self._producer.send(f"{key}:{i}".encode(), partition_key=key)
                i += 1
                self.acked = i
        except BaseException as exc:  # reported by wait_for_more() and check()
            self.errors.append(exc)

    def _receive(self) -> None:
        try:
            while not self._stop_consumer.is_set():
                try:
                    msg = self._consumer.receive(timeout_millis=200)
                except pulsar.Timeout:
                    continue
                self.values.append(msg.data().decode())
                self._consumer.acknowledge(msg)
        except BaseException as exc:
            self.errors.append(exc)

    def wait_for_more(self, n: int) -> None:
        target = self.acked + n
        wait_for(lambda: self.acked >= target or bool(self.errors), timeout=scaled(120),
                 what=f"{n} more messages acknowledged to the Pulsar client")
        assert not self.errors, f"the Pulsar client failed: {self.errors!r}"

    def stop_producing(self) -> int:
        self._stop.set()
        self._threads[0].join(timeout=scaled(120))
        assert not self._threads[0].is_alive(), "the Pulsar producer did not stop"
        assert not self.errors, f"the Pulsar client failed: {self.errors!r}"
        return self.acked

    def check(self, acked: int) -> None:
        """The consumer received every acknowledged message, every key in order (where each
        came first: a redelivery after a move starts again from the last acknowledgement
        the store had)."""
        wait_for(lambda: bool(self.errors) or set(range(acked)) <= {
            int(v.split(":")[1]) for v in list(self.values)}, timeout=scaled(60),
                 what="the Pulsar consumer to receive every message acknowledged")
        self._stop_consumer.set()
        self._threads[1].join(timeout=scaled(30))
        assert not self.errors, f"the Pulsar client failed: {self.errors!r}"
        check_exactly_once_in_order(list(dict.fromkeys(self.values)), acked)

    def kill(self) -> None:
        """Stop both threads and close the client (a teardown's name for it, as for the
        processes beside it)."""
        self._stop.set()
        self._stop_consumer.set()
        for thread in self._threads:
            thread.join(timeout=scaled(30))
        # its checks are done: a producer or consumer still reconnecting (the last fault
        # was just now) makes close() raise NotConnected, which says nothing of the store
        with contextlib.suppress(Exception):
            self._client.close()
