"""Following reads ride out broker restarts: no gap, no duplicate; then one clear error."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import UnavailableError

from .. import forkserver
from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/web/restarts"


def _send(url: str, start: int, count: int) -> None:
    with Producer(TOPIC, broker=url, batch_size=5) as producer:
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i % 7}"}
                           for i in range(start, start + count))


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_local_tail_rides_out_a_broker_restart(start_broker, free_port, data_dir, how
                                                 ) -> None:
    broker: BrokerProcess = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 3)
    _send(broker.url, 0, 30)
    seen: list[bytes] = []
    errors: list[BaseException] = []
    it = tierstream.tail(TOPIC, start="earliest", broker=broker.url, data_dir=str(data_dir))

    def follow() -> None:
        try:
            for batch in it:
                seen.extend(batch.column("value").to_pylist())
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for(lambda: len(seen) == 30, what="the first 30 messages")
    broker.kill() if how == "kill" else broker.stop()
    restarted = start_broker(port=free_port)
    _send(restarted.url, 30, 30)
    wait_for(lambda: len(seen) >= 60 or bool(errors), what="the messages after the restart")
    it.close()
    assert not errors, errors
    assert sorted(seen) == sorted(f"v{i}".encode() for i in range(60))  # no gap, no duplicate


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return forkserver.popen([sys.executable, "-m", "tierstream", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


#: long enough to ride out a restart on a busy machine, short enough to wait for the give-up
GIVE_UP = f"{scaled(3):g}s"


def test_consume_follow_rides_out_a_restart_and_fails_clearly_when_it_stays_down(
        start_broker, free_port) -> None:
    broker: BrokerProcess = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    _send(broker.url, 0, 10)
    proc = _cli("consume", TOPIC, "--follow", "--broker", broker.url or "",
                env={"TIERSTREAM_RECONNECT_TIMEOUT": GIVE_UP})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    try:
        wait_for(lambda: len(lines) == 10, what="consume --follow to print 10 messages")
        broker.stop()  # a clean restart: the broker ends its streams
        restarted = start_broker(port=free_port)
        _send(restarted.url, 10, 10)
        wait_for(lambda: len(lines) == 20, what="the messages after the restart")
        restarted.kill()  # and now it stays down
        code = proc.wait(timeout=scaled(30))
    finally:
        proc.kill()
    values = sorted(json.loads(line)["value"] for line in lines)
    assert values == sorted(f"v{i}" for i in range(20))
    stderr = (proc.stderr.read() if proc.stderr else "").strip()
    assert code == 1, stderr
    assert f"option reconnectTimeout {GIVE_UP}" in stderr and "Traceback" not in stderr
    assert "it stayed unavailable for" in stderr
    assert len(stderr.splitlines()) == 1, stderr


def _readers(url: str, topic: str) -> int:
    with Admin(url) as admin:
        return int(admin.topic_stats(topic)["readers"])


def test_a_follower_that_delivered_nothing_resumes_where_it_started_after_a_kill(
        start_broker, free_port) -> None:
    # Regression: `consume --from latest --follow`, broker SIGKILLed and restarted, then two
    # messages: the follower printed only the second. It reconnected at a "latest" taken
    # again, after the first. And a follower of a quiet topic, in a second outage more than
    # reconnectTimeout after the first, gave up at once: "stayed unavailable for 60s".
    quiet = TOPIC + "-quiet"
    broker: BrokerProcess = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
        admin.create_topic(quiet, 1)
    _send(broker.url, 0, 3)  # before the follower: not for it
    env = {"TIERSTREAM_RECONNECT_TIMEOUT": GIVE_UP}
    follower = _cli("consume", TOPIC, "--from", "latest", "--follow", "--broker",
                    broker.url or "", env=env)
    idle = _cli("consume", quiet, "--from", "latest", "--follow", "--broker", broker.url or "",
                env=env)
    lines: list[str] = []
    idle_lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(follower.stdout or []), daemon=True).start()
    threading.Thread(target=lambda: idle_lines.extend(idle.stdout or []), daemon=True).start()
    try:
        wait_for(lambda: _readers(broker.url or "", TOPIC) == 1
                 and _readers(broker.url or "", quiet) == 1, what="the followers' streams")
        broker.kill()
        restarted = start_broker(port=free_port)
        _send(restarted.url, 3, 1)  # while the follower is still backing off
        wait_for(lambda: _readers(restarted.url or "", TOPIC) == 1
                 and _readers(restarted.url or "", quiet) == 1,
                 what="the followers to reconnect")
        _send(restarted.url, 4, 1)
        wait_for(lambda: len(lines) == 2, what="both messages after the kill")
        # a second outage, longer after the first than reconnectTimeout: ridden out again
        threading.Event().wait(scaled(3) + 1)
        restarted.kill()
        again = start_broker(port=free_port)
        with Producer(quiet, broker=again.url) as producer:
            producer.send(b"w0")
        wait_for(lambda: len(idle_lines) == 1 or idle.poll() is not None,
                 what="the quiet topic's message after the second kill")
    finally:
        follower.kill()
        idle.kill()
    assert [json.loads(line)["value"] for line in lines] == ["v3", "v4"]
    assert [json.loads(line)["value"] for line in idle_lines] == ["w0"], \
        idle.stderr.read() if idle.stderr else ""


def test_reconnect_timeout_is_an_option() -> None:
    from tierstream.errors import ConfigError
    from tierstream.options import parse_options

    assert parse_options({"reconnectTimeout": "5s"}, scope="read")["reconnectTimeout"] == 5000
    with pytest.raises(ConfigError, match="reconnectTimeout"):
        parse_options({"reconnectTimeout": "soon"}, scope="client")


def _receiver(consumer: Any, into: list[str]) -> Any:
    """``receive(timeout)`` of ``consumer`` that adds the values it got to ``into`` and says
    whether anything came."""
    def receive(timeout: float) -> bool:
        batch = consumer.receive(timeout=timeout)
        if batch is not None:
            into.extend(v.decode() for v in batch.column("value").to_pylist())
        return batch is not None

    return receive


def _received_within(receive: Any, seconds: float) -> bool:
    """Whether ``receive`` got something within ``seconds`` (no failure if not)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if receive(0.1):
            return True
    return False


def _held_then_crash(start_broker, free_port, mode: str = "key_shared", name: str = "a"
                     ) -> tuple[BrokerProcess, Any, list[Any]]:
    """A broker, a consumer ``name`` of ``mode`` holding all 200 messages of a one-partition
    topic unacknowledged, and then a broker SIGKILL and restart: (the new broker, the
    consumer, its batches)."""
    from tierstream.client import Consumer
    from tierstream.model.positions import Offset

    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/acks", 1)
    with Producer("acme/web/acks", broker=broker.url, batch_size=20) as producer:
        producer.send_many({"key": f"k{i}", "value": f"v{i}".encode()} for i in range(200))
    a = Consumer("acme/web/acks", "billing", mode=mode, consumer_name=name,
                 initial=Offset.earliest(), broker=broker.url)
    held: list[Any] = []

    def holds_all() -> bool:
        batch = a.receive(timeout=0.1)
        if batch is not None:
            held.append(batch)
        return sum(b.num_rows for b in held) == 200

    wait_for(holds_all, timeout=scaled(30), what="consumer a to hold every message")
    broker.kill()
    return start_broker(port=free_port), a, held


def test_an_ack_whose_messages_the_restarted_broker_gave_another_consumer_says_so(
        start_broker, free_port) -> None:
    """Regression: an ack of messages received before a broker crash returned normally,
    though the restarted broker had given them to another consumer already, which then
    received them after the ack returned. Now the ack is stored and raises AckInDoubtError
    naming exactly those messages."""
    from tierstream.client import Consumer

    broker, a, held = _held_then_crash(start_broker, free_port)
    b = Consumer("acme/web/acks", "billing", mode="key_shared", consumer_name="b",
                 broker=broker.url)
    try:
        got_b: list[str] = []
        receive_b = _receiver(b, got_b)
        # usually b attaches first after the restart and is sent some of a's messages; if a's
        # own re-attach wins, a holds them all, b gets none, and no ack is in doubt
        _received_within(receive_b, scaled(5))
        doubted = 0
        for batch in held:
            try:
                a.ack(batch)
            except tierstream.AckInDoubtError as exc:
                doubted += exc.messages
        while receive_b(scaled(1)):  # what b was sent before the acks came
            pass
        assert doubted == len(set(got_b))
        with Admin(broker.url) as admin:
            wait_for(lambda: sum(r["backlog"] for r in admin.subscriptions("acme/web/acks"))
                     == 0, timeout=scaled(30), what="a backlog of 0")
    finally:
        a.close()
        b.close()


def test_an_ack_after_a_crash_that_nobody_else_could_see_returns(start_broker,
                                                                 free_port) -> None:
    """The other side: alone on its subscription, the consumer's acks of what it received
    before the crash return normally, and nothing of it comes again."""
    broker, a, held = _held_then_crash(start_broker, free_port)
    try:
        for batch in held:
            a.ack(batch)
        assert a.receive(timeout=scaled(1)) is None
        with Admin(broker.url) as admin:
            assert sum(r["backlog"] for r in admin.subscriptions("acme/web/acks")) == 0
    finally:
        a.close()


def test_a_cumulative_ack_whose_messages_a_failover_standby_got_after_a_crash_says_so(
        start_broker, free_port) -> None:
    """The same for ack_cumulative: failover consumer z held everything when the broker was
    killed; after the restart consumer a (first by name, so active once both are back) was
    sent some of it before z's cumulative ack came."""
    from tierstream.client import Consumer

    broker, z, held = _held_then_crash(start_broker, free_port, mode="failover", name="z")
    a = Consumer("acme/web/acks", "billing", mode="failover", consumer_name="a",
                 broker=broker.url)
    try:
        got_a: list[str] = []
        receive_a = _receiver(a, got_a)
        _received_within(receive_a, scaled(5))  # as above: unless z's re-attach won
        doubted = 0
        try:
            z.ack_cumulative(held[-1])
        except tierstream.AckInDoubtError as exc:
            doubted = exc.messages
        while receive_a(scaled(1)):  # what a was sent before the ack came
            pass
        assert doubted == len(set(got_a))
    finally:
        z.close()
        a.close()


def _attached(url: str, topic: str) -> int:
    """Partitions of ``topic`` with a consumer attached."""
    with Admin(url) as admin:
        return sum(1 for row in admin.subscriptions(topic) if row["consumers"])


def test_a_consumer_of_a_partition_with_no_new_messages_rides_out_restarts_far_apart(
        start_broker, free_port, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (cluster chaos: 'consumer ... lost the broker ... unavailable for 60s'
    with every broker answering): a partition's stream took its reconnect window from its
    first outage until a batch came, so a partition nobody wrote to spent the window over
    several outages and gave up at a later short one. Each re-attach now ends its outage."""
    from tierstream.client import Consumer

    window = scaled(3)
    monkeypatch.setenv("TIERSTREAM_RECONNECT_TIMEOUT", f"{window:g}s")
    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/quiet", 2)
    consumer = Consumer("acme/web/quiet", "audit", broker=broker.url)
    try:
        for _ in range(2):
            broker.kill()
            broker = start_broker(port=free_port)
            # both partitions' streams attached again ...
            wait_for(lambda u=broker.url: _attached(u, "acme/web/quiet") == 2,
                     timeout=scaled(30), what="the consumer to attach again")
            time.sleep(window)  # ... and the next outage comes later than the window
        with Producer("acme/web/quiet", broker=broker.url) as producer:
            producer.send_many({"value": f"v{i}".encode()} for i in range(10))
        got = 0
        while got < 10:
            batch = consumer.receive(timeout=scaled(30))
            assert batch is not None, f"received {got} of 10"
            got += batch.num_rows
    finally:
        consumer.close()


def test_a_reattach_the_broker_fails_after_taking_the_consumer_leaves_no_consumer_behind(
        start_broker, free_port) -> None:
    """Regression: an attach that failed after the dispatcher had taken the consumer (its
    cursor write refused, any error before its stream started) left the consumer attached
    with no stream. The client, told to try again, met itself: "already has a consumer
    named 'a' connected", and its consumer died. (A fresh clone's suite saw this after a
    broker restart.) Now the failed attach takes the consumer back."""
    from tierstream.client import Consumer
    from tierstream.model.positions import Offset

    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/reattach", 1)
    with Producer("acme/web/reattach", broker=broker.url) as producer:
        producer.send_many({"key": f"k{i}", "value": f"v{i}".encode()} for i in range(10))
    a = Consumer("acme/web/reattach", "billing", mode="exclusive", consumer_name="a",
                 initial=Offset.earliest(), broker=broker.url)
    try:
        got: list[str] = []

        def receives(n: int) -> Callable[[], bool]:
            def check() -> bool:
                batch = a.receive(timeout=0.1)
                if batch is not None:
                    got.extend(v.decode() for v in batch.column("value").to_pylist())
                    a.ack(batch)
                return len(set(got)) >= n
            return check

        wait_for(receives(10), timeout=scaled(30), what="the first 10 messages")
        broker.kill()
        # the restarted broker fails the consumer's first re-attach after taking it
        broker = start_broker(port=free_port, env={"TIERSTREAM_FAULT_AT": "consumer.attached"})
        with Producer("acme/web/reattach", broker=broker.url) as producer:
            producer.send_many({"key": f"k{i}", "value": f"v{i}".encode()}
                               for i in range(10, 15))
        wait_for(receives(15), timeout=scaled(60), what="the 5 messages after the restart")
        restarted = broker  # (the fault fired: the broker logs it)
        wait_for(lambda: "fault point consumer.attached" in "".join(restarted.stderr_tail),
                 timeout=scaled(10), what="the broker to log the failed attach")
    finally:
        a.close()


def test_a_producer_that_gave_up_on_a_hung_broker_leaves_arrow_nothing_to_complain_of(
        start_broker, capfd, monkeypatch) -> None:
    """A produce stream given up on while its call still waits inside Flight (the broker hung)
    is closed by its own thread once the call returns (here: the broker is killed), not left
    to Arrow's destructor, which prints the close's error to the user's stderr as
    ``Close() failed: IOError: ... Stream removed`` after every hang and partition move."""
    monkeypatch.setenv("TIERSTREAM_RECONNECT_TIMEOUT", f"{scaled(2):g}s")
    broker: BrokerProcess = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    producer = Producer(TOPIC, broker=broker.url, send_timeout=scaled(2))
    producer.send_many([{"key": "k", "value": b"before"}])
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    with pytest.raises(UnavailableError):
        producer.send_many([{"key": "k", "value": b"into the hang"}])

    def streams() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "tierstream-produce-io"]

    assert streams(), "no produce stream was left waiting on the hung broker"
    broker.kill()  # the calls still waiting on the hung broker fail now
    with contextlib.suppress(UnavailableError):
        producer.close()
    wait_for(lambda: not streams(), what="the streams given up on to end")
    gc.collect()
    err = capfd.readouterr().err
    assert "Close() failed" not in err, err


def test_a_consumer_whose_broker_is_down_leaves_the_reconnect_to_its_pump(
        start_broker, caplog, monkeypatch) -> None:
    """The keepalive is for a stream that looks alive. One the broker closed is its pump's to
    attach again, which says so once: the keepalive warned "did not answer its keepalive in
    time; attaching again" every keepalive for as long as the broker stayed down, and after
    the consumer had given up on it."""
    monkeypatch.setenv("TIERSTREAM_RECONNECT_TIMEOUT", f"{scaled(4):g}s")
    broker: BrokerProcess = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    _send(broker.url, 0, 1)
    with Consumer(TOPIC, "sub", broker=broker.url, initial="earliest",
                  keepalive=scaled(0.5)) as consumer:
        assert consumer.receive(timeout=scaled(30)) is not None
        with caplog.at_level(logging.INFO, logger="tierstream"):
            broker.kill()
            with pytest.raises(UnavailableError, match="stayed unavailable"):
                deadline = time.monotonic() + scaled(60)
                while time.monotonic() < deadline:
                    consumer.receive(timeout=scaled(1))
            time.sleep(scaled(1))  # two keepalives after the give-up
    said = [r.getMessage() for r in caplog.records]
    assert any("reconnecting" in m for m in said), said
    assert not [m for m in said if "keepalive" in m], said
