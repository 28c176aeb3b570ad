"""Every long-lived thread has an owner: a fault point (``util/faults.py``) raises an error
nobody foresaw in its body, and its owner reports it with its stack and gives its work back —
nothing hangs. (The Pulsar listener's threads: ``tests/pulsar_wire/test_pulsar_faults.py``;
the metadata heartbeat: ``test_metadata_backends.py``.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import TierstreamError
from tierstream.model.positions import Offset
from tierstream.util.faults import FAULT_ENV

from ..timing import scaled
from .helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("point", "thread", "dies"), [
    # the client's sender or watchdog gone: appends would wait for good, so every one fails
    # at once and placement stops choosing the bookie
    ("bookie.client.send@3", "remote-bookie-b0-send", True),
    ("bookie.client.watch@2", "remote-bookie-b0-watch", True),
    # a stream's receiver, or the bookie's answer thread: that stream fails, the next serves
    ("bookie.client.receive@3", "remote-bookie-b0-recv", False),
    ("bookie.acks@3", "bookie-b0-acks", False),
])
def test_a_network_bookie_thread_that_fails_fails_its_appends_and_hangs_nothing(
        tmp_path, point: str, thread: str, dies: bool) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.store.bookie_threads",
                           str(tmp_path / "b0")], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(120), env={**os.environ, FAULT_ENV: point})
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert f"{thread} stopped by an unexpected error" in done.stderr  # with its stack
    assert "InjectedFault" in done.stderr
    assert outcome["failed"] >= 1
    if dies:
        assert outcome["dead_after"] and not outcome["available"], outcome
    else:
        assert not outcome["dead_after"] and outcome["available"], outcome
        assert outcome["stored"] >= 10, outcome  # before and after the failed stream


def test_a_housekeeping_thread_that_fails_stops_the_broker_saying_why(start_broker) -> None:
    broker = start_broker(env={FAULT_ENV: "store.housekeeping@3"})
    assert broker.proc is not None
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what="the broker to stop")
    said = "".join(broker.stderr_tail)
    assert broker.proc.returncode == 1 and broker.proc.returncode != -signal.SIGKILL, said
    assert "store-housekeeping stopped by an unexpected error" in said
    assert "the store's housekeeping failed" in said and "the broker stopped" in said


def _ack_and_dead_letter(broker: BrokerProcess) -> None:
    """Work for the subscriptions' threads, until the broker stops: a message acked (the
    cursor writer) and, on a topic of its own, one nacked past its redeliveries (the
    dead-letter writer); the timer runs by itself. Errors are the broker stopping under it."""
    url = broker.url or ""

    def stopped() -> bool:
        return broker.proc is None or broker.proc.poll() is not None

    with contextlib.suppress(TierstreamError):
        with Admin(url) as admin:
            admin.create_topic("a/threads/acked", 1)
            admin.create_topic("a/threads/nacked", 1)
        for topic in ("a/threads/acked", "a/threads/nacked"):
            with Producer(topic, broker=url) as producer:
                producer.send(topic.rsplit("/", 1)[1])
        with Consumer("a/threads/acked", "s", broker=url, initial=Offset.earliest()) as c:
            batch = c.receive(timeout=scaled(10))
            if batch is not None:
                c.ack(batch)
        with Consumer("a/threads/nacked", "s", mode="shared", broker=url,
                      initial=Offset.earliest(), nack_delay=0.05, max_redeliveries=1) as c:
            deadline = time.monotonic() + scaled(30)
            while not stopped() and time.monotonic() < deadline:
                batch = c.receive(timeout=scaled(1))
                if batch is not None:
                    c.nack(batch)


@pytest.mark.parametrize(("point", "thread", "what"), [
    # no ack timeout, nack delay or delayed message would come due again
    ("subscriptions.tick@20", "subscription-timer", "the subscriptions' timer"),
    # every ack would fail from then on
    ("cursor.write@1", "cursor-writer", "the cursor writer"),
    # messages past their redeliveries would wait for good
    ("dead_letters.write@1", "dead-letters", "the dead-letter writer"),
])
def test_a_subscription_thread_that_fails_stops_the_broker_saying_why(
        start_broker, point: str, thread: str, what: str) -> None:
    """Regression: these were bare threads; an error nobody foresaw ended one silently, and
    the broker served on without it."""
    broker = start_broker(env={FAULT_ENV: point})
    assert broker.proc is not None and broker.url is not None
    _ack_and_dead_letter(broker)
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what="the broker to stop")
    said = "".join(broker.stderr_tail)
    assert broker.proc.returncode == 1, said[-3000:]
    assert f"{thread} stopped by an unexpected error" in said and "InjectedFault" in said
    assert f"{what} failed" in said and "the broker stopped" in said, said[-3000:]


def test_a_bookie_journal_that_fails_fails_its_appends_and_hangs_nothing(tmp_path) -> None:
    """Regression: the journal was a bare thread; an error nobody foresaw ended it and every
    append queued then or later waited for good (the broker's produce with it)."""
    done = subprocess.run([sys.executable, "-m", "tests.store.bookie_threads",
                           str(tmp_path / "b0"), "journal"], cwd=ROOT, capture_output=True,
                          text=True, timeout=scaled(120),
                          env={**os.environ, FAULT_ENV: "bookie.journal@3"})
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert "bookie-b0-journal stopped by an unexpected error" in done.stderr
    assert outcome["stored"] == 2 and len(outcome["failed"]) == 8, outcome  # its 3rd pass
    assert all("the journal of bookie b0 stopped" in e for e in outcome["failed"]), outcome
    assert "the journal of bookie b0 stopped" in outcome["later"], outcome


def test_a_local_bookie_journal_that_fails_stops_the_broker_saying_why(start_broker) -> None:
    broker = start_broker(env={FAULT_ENV: "bookie.journal@2"})
    assert broker.proc is not None and broker.url is not None
    with contextlib.suppress(TierstreamError), Admin(broker.url) as admin:
        admin.create_topic("a/threads/j", 1)
        with Producer("a/threads/j", broker=broker.url, send_timeout=scaled(10)) as producer:
            for i in range(5):
                producer.send(f"v{i}")
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what="the broker to stop")
    said = "".join(broker.stderr_tail)
    assert broker.proc.returncode == 1, said[-3000:]
    assert "bookie-bookie-0-journal stopped by an unexpected error" in said, said[-3000:]
    assert "the journal of bookie-0 failed" in said and "the broker stopped" in said


def test_a_network_bookie_whose_journal_fails_stops_saying_why(tmp_path, postgres) -> None:
    """The bookie process goes, so that brokers take it for gone and place segments on the
    others, instead of one that answers every append with an error for good."""
    from ..network_store import BookieProcess, broker_args

    url = postgres.new_database()
    bookie = BookieProcess(tmp_path / "b0", url, host_label="h0", bookie_id="b0",
                           env={FAULT_ENV: "bookie.journal@2"}).start()
    try:
        with BrokerProcess(tmp_path / "broker", args=broker_args(url)) as broker:
            assert broker.url is not None
            with contextlib.suppress(TierstreamError), Admin(broker.url) as admin:
                admin.create_topic("a/threads/n", 1)
                with Producer("a/threads/n", broker=broker.url,
                              send_timeout=scaled(10)) as producer:
                    for i in range(5):
                        producer.send(f"v{i}")
            assert bookie.proc is not None
            code = bookie.proc.wait(timeout=scaled(60))
        said = "".join(bookie.stderr_tail)
        assert code == 1, said[-3000:]
        assert "bookie-b0-journal stopped by an unexpected error" in said, said[-3000:]
        last = [line for line in said.splitlines() if line.strip()][-1]
        assert last.startswith("error: the journal of bookie") and "the bookie stopped" in last
    finally:
        bookie.kill()


_WATCHED = """
import sys
import threading
from tierstream.client import Consumer
from tierstream.errors import TierstreamError
from tierstream.model.positions import Offset

with Consumer("a/threads/watched", "s", broker=sys.argv[1], initial=Offset.earliest()) as c:
    try:
        while True:
            c.receive(timeout=1)
    except TierstreamError as exc:
        print("receive raised:", exc)
"""


def test_a_consumer_whose_partition_watcher_fails_says_so_at_its_next_receive(
        start_broker) -> None:
    """The consumer's watcher follows a topic's scale events; an unforeseen error ended it
    silently, and the consumer then never read a partition added later."""
    broker = start_broker()
    with Admin(broker.url or "") as admin:
        admin.create_topic("a/threads/watched", 1)
    done = subprocess.run([sys.executable, "-c", _WATCHED, broker.url or ""], cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled(60),
                          env={**os.environ, FAULT_ENV: "consumer.watch@2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-watch stopped by an unexpected error" in done.stderr, done.stderr[-3000:]
    assert "receive raised: consumer" in done.stdout, done.stdout
    assert "stopped watching for new partitions" in done.stdout, done.stdout


def _new_threads(before: set[int | None]) -> list[str]:
    """Python threads started since ``before`` and still alive, but the ones C++ threads of
    gRPC register when they call into Python (``Dummy-N``: not ours to join)."""
    return sorted(t.name for t in threading.enumerate()
                  if t.ident not in before and t.is_alive() and not t.name.startswith("Dummy"))


def test_no_thread_of_a_broker_is_left_once_it_stops(tmp_path: Path) -> None:
    """Every thread a broker starts has an owner that stops and joins it (issue 75 §2): its
    dispatchers' readers, produce streams' ack writers, a transaction's confirmer, the Pulsar
    listener and admin REST servers, its housekeeping and subscriptions' threads."""
    import pulsar

    from tierstream.broker.pulsar.admin_http import AdminServer
    from tierstream.broker.pulsar.server import PulsarServer

    from ..logs import running_log

    before = {t.ident for t in threading.enumerate()}
    with running_log(tmp_path / "data") as log:
        listener = PulsarServer(log.store, port=0, schemas=log.broker.schemas,
                                subscriptions=log.broker.subscriptions,
                                streams=log.broker.streams)
        admin_rest = AdminServer(log.broker, host="127.0.0.1", port=0,
                                 pulsar_url=listener.url)
        try:
            with Admin(log.url) as admin:
                admin.create_topic("a/threads/all", 2)
            with Producer("a/threads/all", broker=log.url) as producer:
                producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(100))
                with producer.transaction():
                    producer.send_many({"key": f"k{i}", "value": b"t"} for i in range(10))
            with Consumer("a/threads/all", "s", mode="key_shared", broker=log.url,
                          initial=Offset.earliest()) as consumer:
                got = 0
                while got < 110 and (batch := consumer.receive(timeout=scaled(10))):
                    got += batch.num_rows
                    consumer.ack(batch)
            client = pulsar.Client(listener.url)
            try:
                reader = client.subscribe("persistent://a/threads/all", "p",
                                          initial_position=pulsar.InitialPosition.Earliest)
                reader.acknowledge(reader.receive(timeout_millis=int(scaled(10) * 1000)))
            finally:
                client.close()
        finally:
            admin_rest.shutdown()
            listener.shutdown()
    assert got == 110
    wait_for(lambda: not _new_threads(before), timeout=scaled(10),
             what=f"the broker's threads to end: {_new_threads(before)}")
