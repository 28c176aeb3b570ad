"""Every client entry takes the whole broker list: with the first broker named down, each CLI
command and each Python entry goes on with the next (issues 47 and 48)."""

from __future__ import annotations

from typing import Any

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer, read
from tierstream.model.positions import Offset
from tierstream.spark_adapter.source import register

from ..cli.test_cli import run
from ..timing import scaled

TOPIC = "acme/lists/events"


@pytest.fixture
def brokers(broker: BrokerProcess, free_port: int) -> str:
    """``grpc://<nobody listens>,<the broker>``, with a topic of 2 partitions and 20
    messages."""
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=broker.url) as producer:
        producer.send_many({"key": f"k{i % 5}", "value": f"v{i}".encode()} for i in range(20))
    return f"grpc://127.0.0.1:{free_port},{broker.url}"


def _count(batches: Any) -> int:
    return sum(b.num_rows for b in batches)


def test_every_python_entry_goes_on_with_the_next_broker(brokers: str, spark: Any) -> None:
    assert _count(read(TOPIC, broker=brokers, end=Offset.latest())) == 20
    assert tierstream.read(TOPIC, broker=brokers).num_rows == 20
    assert _count(tierstream.scan(TOPIC, broker=brokers)) == 20
    assert tierstream.plan(TOPIC, broker=brokers)
    with tierstream.tail(TOPIC, broker=brokers, start="earliest") as following:
        got = 0
        for batch in following:
            got += batch.num_rows
            if got >= 20:
                break
    with Admin(brokers) as admin:
        assert admin.get_topic(TOPIC).partitions == 2
    with Producer(TOPIC, broker=brokers) as producer:
        producer.send_many([{"key": "k0", "value": b"v20"}])
    with Consumer(TOPIC, "lists", broker=brokers, initial=Offset.earliest()) as consumer:
        received = 0
        while received < 21:
            batch = consumer.receive(timeout=scaled(30))
            assert batch is not None, f"received {received} of 21"
            consumer.ack(batch)
            received += batch.num_rows
    register(spark)
    frame = spark.read.format("tierstream").options(topic=TOPIC, broker=brokers).load()
    assert frame.count() == 21


@pytest.mark.parametrize("command", [
    ["produce", TOPIC], ["consume", TOPIC, "--limit", "5"],
    ["read", TOPIC, "--out", "{tmp}/out.parquet"], ["segments", TOPIC], ["broker", "stats"],
    ["topic", "list"],
    ["topic", "stats", TOPIC], ["plan", TOPIC], ["subscriptions", TOPIC]],
    ids=" ".join)
def test_every_cli_command_goes_on_with_the_next_broker(brokers: str, command: list[str],
                                                        tmp_path: Any) -> None:
    done = run(*[a.format(tmp=tmp_path) for a in command], "--broker", brokers,
               stdin='{"key": "k", "value": "x"}\n')
    assert done.returncode == 0, done.stderr
    assert "cannot reach" not in done.stderr, done.stderr


def test_a_client_naming_several_brokers_waits_for_one_while_none_answers(
        start_broker: Any, data_dir: Any, free_port: int) -> None:
    """Regression: during a takeover neither broker answers for a while (the old one is
    dead, the standby not yet serving), and every ``produce`` in that window failed at once
    with ``cannot reach the broker``. A client that names several brokers now waits for one
    (round after round, with backoff, up to FAILOVER_WAIT_S), as Pulsar's clients do."""
    import socket
    import subprocess
    import sys
    import time

    first = start_broker(port=free_port)
    with Admin(first.url) as admin:
        admin.create_topic(TOPIC, 1)
    first.stop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    brokers = f"grpc://127.0.0.1:{dead},grpc://127.0.0.1:{free_port}"
    message = data_dir.parent / "message.json"
    message.write_text('{"value": "during the takeover"}\n')
    with message.open() as stdin:
        producing = subprocess.Popen(
            [sys.executable, "-m", "tierstream", "produce", TOPIC, "--broker", brokers],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert producing.stderr is not None
    deadline = time.monotonic() + scaled(30)
    said = producing.stderr.readline()  # the one line that says it waits
    assert "waiting up to" in said and time.monotonic() < deadline, said
    start_broker(port=free_port)  # the standby serves
    _, err = producing.communicate(timeout=scaled(60))
    assert producing.returncode == 0, said + err
    assert "produced 1 message(s)" in err, err
    with Admin(f"grpc://127.0.0.1:{free_port}") as admin:
        assert admin.get_topic(TOPIC).partitions == 1
    assert _count(read(TOPIC, broker=f"grpc://127.0.0.1:{free_port}",
                       end=Offset.latest())) == 1


def test_a_producer_passes_a_fenced_broker_over_while_the_next_does_not_answer_yet(
        start_broker: Any, tmp_path: Any, free_port: int,
        caplog: pytest.LogCaptureFixture) -> None:
    """Regression: at a takeover, a fenced broker that still runs refused each batch, the
    producer moved on to the next broker named, which did not answer yet, and opening a
    stream fell back to the fenced one at once (Flight opens a stream without a word from
    the broker): the same warning 66 times in 130 ms, a busy loop until the fenced broker
    stopped. A broker that refused as fenced is now passed over for a while."""
    import logging
    import threading
    import time

    from ..logs import running_log
    from .helpers import wait_for

    newer = tmp_path / "newer"
    standby = start_broker(port=free_port, data=newer)
    with Admin(standby.url) as admin:
        admin.create_topic(TOPIC, 1)
    standby.stop()
    caplog.set_level(logging.WARNING, logger="tierstream.client")
    with running_log(tmp_path / "old") as old:
        old.store.create_topic(TOPIC, 1)
        producer = Producer(TOPIC, broker=f"{old.url},grpc://127.0.0.1:{free_port}")
        producer.send_many({"key": "k", "value": f"before {i}".encode()} for i in range(10))
        producer.flush()
        old.store._on_fenced(TOPIC, 0, "a newer broker took the store over")  # a bookie's refusal
        failed: list[BaseException] = []

        def send() -> None:
            try:
                producer.send_many({"key": "k", "value": f"after {i}".encode()}
                                   for i in range(10))
                producer.flush()
            except BaseException as exc:  # reported by the test's thread
                failed.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        wait_for(lambda: "no longer serves the store (fenced)" in caplog.text, scaled(30),
                 what="the fenced broker's refusal")
        time.sleep(scaled(1))  # while the next broker does not answer yet
        start_broker(port=free_port, data=newer)  # the standby serves
        sending.join(scaled(60))
        producer.close()
    assert not sending.is_alive() and not failed, failed
    moves = [r.getMessage() for r in caplog.records if "; trying" in r.getMessage()]
    assert len(moves) <= 2, f"{len(moves)} moves: {moves[:3]}"
    values = [v.as_py() for b in read(TOPIC, broker=f"grpc://127.0.0.1:{free_port}",
                                      end=Offset.latest()) for v in b.column("value")]
    assert values == [f"after {i}".encode() for i in range(10)]
