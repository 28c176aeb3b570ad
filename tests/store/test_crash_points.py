"""Crash-point tests of the write path: a real broker process kills itself at each commit point.

Each test arms one point of :mod:`tierstream.util.faults` in the broker's environment, lets a
named producer write until the broker dies there, restarts the broker on the same address and
lets the same producer retry and go on. Then the whole log is read back and checked against the
acknowledgements (:mod:`tests.store.crashcheck`): nothing acknowledged missing, nothing stored
twice, acknowledged positions unchanged, per-key order and publish_time order kept.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import AlreadyExistsError, UnavailableError
from tierstream.model.positions import Offset
from tierstream.util.faults import ENV

from ..timing import scaled
from .crashcheck import check, send_numbered
from .helpers import read_all, wait_for

TOPIC = "acme/crash/orders"
ONE = ("--max-entries-per-segment", "4")
REPLICATED = ("--bookies", "3", "--write-quorum", "3", "--ack-quorum", "2",
              "--max-entries-per-segment", "4")


class Writer:
    """A named producer sending numbered values from a thread until stopped; it rides out
    broker restarts (the producer re-sends what was not acknowledged)."""

    def __init__(self, url: str, *, name: str = "writer") -> None:
        self.producer = Producer(TOPIC, broker=url, name=name, batch_size=3,
                                 send_timeout=scaled(60))
        self.sends: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                self.sends.append(send_numbered(self.producer, n, 7))
                n += 7
        except BaseException as exc:
            self.error = exc

    def wait_for_sends(self, count: int) -> None:
        wait_for(lambda: len(self.sends) >= count or self.error is not None, timeout=scaled(60),
                 what=f"{count} acknowledged sends")
        assert self.error is None, repr(self.error)

    def finish(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=scaled(90))
        assert not self._thread.is_alive(), "the writer did not finish"
        assert self.error is None, repr(self.error)
        self.producer.close()
        return self.sends


def _wait_crashed(broker: BrokerProcess, point: str) -> None:
    assert broker.proc is not None
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None, timeout=scaled(60),
             what=f"the broker to crash at {point}")
    assert broker.proc.returncode == -signal.SIGKILL, "".join(broker.stderr_tail)[-2000:]


def _crash_writing(start_broker: Callable[..., BrokerProcess], port: int, point: str,
                   args: tuple[str, ...], *, partitions: int = 1) -> tuple[BrokerProcess, Writer]:
    """A broker armed at ``point``, a topic, and a writer running until the broker dies."""
    broker = start_broker(*args, port=port, env={ENV: point})
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, partitions)
    writer = Writer(broker.url)
    _wait_crashed(broker, point)
    return broker, writer


def _restart_and_check(start_broker: Callable[..., BrokerProcess], port: int,
                       args: tuple[str, ...], writer: Writer) -> BrokerProcess:
    restarted = start_broker(*args, port=port)
    done = len(writer.sends)
    writer.wait_for_sends(done + 3)  # the retried send is acknowledged, and more after it
    sends = writer.finish()
    report = check(read_all(restarted.url, TOPIC), sends)
    assert report.ok, str(report)
    assert report.acknowledged >= 7 * (done + 3)
    return restarted


WRITE_POINTS = [
    # (point, broker args): counts land mid-stream, after a few rollovers.
    ("append.partial-replicas@9", REPLICATED),
    ("append.partial-replicas@9", ONE),
    ("append.before-ack@9", ONE),
    ("append.before-ack@9", REPLICATED),
    ("roll.bookies-sealed@2", ONE),
    ("roll.bookies-sealed@2", REPLICATED),
    ("roll.metadata-sealed@2", ONE),
    ("roll.metadata-sealed@2", REPLICATED),
    ("roll.next-registered@3", ONE),  # @1 is the topic's first segment
]


@pytest.mark.parametrize(("point", "args"), WRITE_POINTS,
                         ids=[f"{p}-{'wq3' if a is REPLICATED else '1bookie'}"
                              for p, a in WRITE_POINTS])
def test_a_crash_at_each_write_point_loses_and_duplicates_nothing(
        start_broker, free_port, point, args) -> None:
    _, writer = _crash_writing(start_broker, free_port, point, args)
    _restart_and_check(start_broker, free_port, args, writer)


@pytest.mark.parametrize("point", ["roll.metadata-sealed@2", "roll.next-registered@3"])
def test_a_crash_at_a_write_point_with_postgresql_metadata_loses_and_duplicates_nothing(
        start_broker, free_port, postgres, point) -> None:
    args = (*ONE, "--metadata", postgres.new_database())
    _, writer = _crash_writing(start_broker, free_port, point, args)
    _restart_and_check(start_broker, free_port, args, writer)


@pytest.mark.parametrize("point", ["recovery.replica-repaired", "recovery.sealed"])
def test_recovery_interrupted_and_rerun_loses_and_duplicates_nothing(
        start_broker, free_port, point) -> None:
    # A crash that leaves replicas unequal, so recovery has a replica to repair.
    _, writer = _crash_writing(start_broker, free_port, "append.partial-replicas@9", REPLICATED)
    with pytest.raises(UnavailableError, match="exit -9"):
        start_broker(*REPLICATED, port=free_port, env={ENV: point})  # dies while recovering
    _restart_and_check(start_broker, free_port, REPLICATED, writer)


def test_a_crash_after_a_cursor_is_saved_resumes_after_the_ack(start_broker, free_port) -> None:
    # the first cursor write is the subscription's creation, the second the first ack: the
    # broker dies after storing the third (the second ack), before answering it
    broker = start_broker(*ONE, port=free_port, env={ENV: "cursor.saved@3"})
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, name="writer", batch_size=5) as producer:
        sends = [send_numbered(producer, 0, 40)]
    consumer = Consumer(TOPIC, "audit", initial=Offset.earliest(), broker=broker.url)
    first = consumer.receive(timeout=scaled(30))
    assert first is not None and first.num_rows >= 5
    consumer.ack(first.slice(0, 2))
    acking = threading.Thread(target=consumer.ack, args=(first.slice(2, 2),), daemon=True)
    acking.start()  # stored, then the broker dies: the call retries until it is back
    _wait_crashed(broker, "cursor.saved")
    restarted = start_broker(*ONE, port=free_port)
    acking.join(timeout=scaled(60))
    assert not acking.is_alive(), "the ack did not ride out the restart"
    consumer.close()
    with Consumer(TOPIC, "audit", broker=restarted.url) as again:
        batch = again.receive(timeout=scaled(30))
    assert batch is not None
    assert batch.column("value")[0].as_py() == first.column("value")[4].as_py()
    report = check(read_all(restarted.url, TOPIC), sends)
    assert report.ok, str(report)


def test_a_crash_after_a_topic_is_registered_leaves_a_whole_topic(start_broker,
                                                                  free_port) -> None:
    broker = start_broker(*ONE, port=free_port, env={ENV: "topic.registered"})
    with Admin(broker.url) as admin, pytest.raises(UnavailableError):
        admin.create_topic(TOPIC, 3)
    _wait_crashed(broker, "topic.registered")
    restarted = start_broker(*ONE, port=free_port)
    with Admin(restarted.url) as admin:
        with pytest.raises(AlreadyExistsError):
            admin.create_topic(TOPIC, 3)
        assert admin.get_topic(TOPIC).partitions == 3
        assert sorted({s.partition for s in admin.list_segments(TOPIC)}) == [0, 1, 2]
    with Producer(TOPIC, broker=restarted.url, name="writer", batch_size=3) as producer:
        sends = [send_numbered(producer, 0, 30)]
    report = check(read_all(restarted.url, TOPIC), sends)
    assert report.ok and report.acknowledged == 30, str(report)
