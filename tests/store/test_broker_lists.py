"""Every client entry takes the whole broker list: with the first broker named down, each CLI
command and each Python entry goes on with the next (issues 47 and 48)."""

from __future__ import annotations

from typing import Any

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer, read
from tierstream.spark_adapter.source import register
from tierstream.splits.positions import Offset

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
