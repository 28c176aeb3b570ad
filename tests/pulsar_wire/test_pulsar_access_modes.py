"""Pulsar's producer access modes (PIP-68) with the real client: Exclusive, WaitForExclusive
and ExclusiveWithFencing producers, beside shared ones of both kinds (``producer_access.py``).
Regression: any mode but Shared was refused by name, so an application that elects a single
writer with them could not run here."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from typing import Any

import pulsar
import pytest

from tierstream import read
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.errors import ProducerBusyError, ProducerFencedError
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, commands_until, free_port

TOPIC = "acme/access/orders"
NAME = f"persistent://{TOPIC}"
Mode = pulsar.ProducerAccessMode


def _rest_stats(broker: BrokerProcess) -> Any:
    """The topic's stats as Pulsar's admin REST answers them."""
    url = f"{broker.admin_url}/admin/v2/persistent/{TOPIC}/stats"
    with urllib.request.urlopen(url, timeout=scaled(30)) as answer:
        return json.loads(answer.read())


def _producer(client: Any, mode: Any, name: str) -> Any:
    return client.create_producer(NAME, producer_name=name, access_mode=mode,
                                  batching_enabled=False)


def test_exclusive_producers_wait_fence_and_refuse_as_pulsar_s_do(start_broker: Any) -> None:
    pulsar_broker: BrokerProcess = start_broker("--pulsar-port", str(free_port()),
                                                "--admin-port", str(free_port()))
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(pulsar_broker)
    try:
        first = _producer(client, Mode.Exclusive, "first")
        first.send(b"first-1")
        with Admin(pulsar_broker.url) as admin:  # the stats say which mode it holds
            assert [(p["name"], p["access"]) for p in admin.topic_stats(TOPIC)["producers"]] \
                == [("first", "Exclusive")]
        # while it holds the topic: a shared producer is busy, another exclusive one fenced,
        # and a tierstream producer (shared) refused too
        with pytest.raises(pulsar.ProducerBusy):
            _producer(client, Mode.Shared, "shared")
        with pytest.raises(pulsar.ProducerFenced):
            _producer(client, Mode.Exclusive, "second")
        with pytest.raises(ProducerBusyError, match="exclusive producer"), \
                Producer(TOPIC, broker=pulsar_broker.url) as own:
            own.send(value=b"own")
            own.flush()
        # a WaitForExclusive producer is made only once the holder leaves
        waiting: dict[str, Any] = {}
        maker = threading.Thread(target=lambda: waiting.setdefault(
            "producer", _producer(client, Mode.WaitForExclusive, "patient")))
        maker.start()
        maker.join(timeout=1.0)  # a bounded look: it must still be waiting
        assert maker.is_alive() and not waiting
        with Admin(pulsar_broker.url) as admin:
            assert sorted(p["access"] for p in admin.topic_stats(TOPIC)["producers"]) == [
                "Exclusive", "WaitForExclusive (waiting)"]
        # Pulsar's admin REST: the waiting producer is counted, not listed, and every mode
        # is one of Pulsar's names (its Java admin client reads them into an enum);
        # regression: it listed "WaitForExclusive (waiting)"
        rest = _rest_stats(pulsar_broker)
        assert [(p["producerName"], p["accessMode"]) for p in rest["publishers"]] == \
            [("first", "Exclusive")]
        assert rest["waitingPublishers"] == 1
        first.send(b"first-2")
        first.close()
        maker.join(timeout=scaled(30))
        assert not maker.is_alive(), "the waiting producer was never granted the topic"
        patient = waiting["producer"]
        patient.send(b"patient-1")
        # ExclusiveWithFencing takes the topic over: the holder is fenced for good
        taker = _producer(client, Mode.ExclusiveWithFencing, "taker")
        taker.send(b"taker-1")

        def fenced() -> bool:
            try:
                patient.send(b"patient-after-fencing")
            except pulsar.PulsarException:
                return True
            return False

        wait_for(fenced, timeout=scaled(30), what="the fenced producer's sends to fail")
        taker.close()
    finally:
        client.close()
    values = sorted(v.decode() for v in read(TOPIC, broker=pulsar_broker.url)
                    .column("value").to_pylist())
    assert values == ["first-1", "first-2", "patient-1", "taker-1"]


def test_a_tierstream_producer_keeps_exclusive_ones_out_until_one_fences_it(
        pulsar_broker: BrokerProcess) -> None:
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(pulsar_broker)
    own = Producer(TOPIC, broker=pulsar_broker.url)
    try:
        own.send(value=b"own-1")
        own.flush()  # its produce stream is open: a shared producer is attached
        with pytest.raises(pulsar.ProducerFenced):
            _producer(client, Mode.Exclusive, "exclusive")
        taker = _producer(client, Mode.ExclusiveWithFencing, "taker")
        taker.send(b"taker-1")
        with pytest.raises(ProducerFencedError, match="ExclusiveWithFencing"):
            own.send(value=b"own-after-fencing")
            own.flush()
        taker.close()
    finally:
        client.close()
        own.close()
    values = sorted(v.decode() for v in read(TOPIC, broker=pulsar_broker.url)
                    .column("value").to_pylist())
    assert values == ["own-1", "taker-1"]


def test_an_exclusive_producer_keeps_the_topic_across_a_broker_sigkill(
        start_broker: Any, free_port: int) -> None:
    """The epochs live in the broker's memory: after a restart the exclusive producer that
    reconnects (with its epoch) holds the topic again, and another is still kept out."""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(broker)
    try:
        holder = client.create_producer(NAME, producer_name="holder", access_mode=Mode.Exclusive,
                                        batching_enabled=False,
                                        send_timeout_millis=int(scaled(60) * 1000))
        holder.send(b"before")
        broker.kill()
        broker = start_broker("--pulsar-port", str(free_port))
        holder.send(b"after")  # reconnected, and still the topic's only producer
        with pytest.raises(pulsar.ProducerFenced):
            _producer(client, Mode.Exclusive, "intruder")
    finally:
        client.close()
    values = sorted(v.decode() for v in read(TOPIC, broker=broker.url)
                    .column("value").to_pylist())
    assert values == ["after", "before"]


def _returning_producer(broker: BrokerProcess, epoch: int) -> api.BaseCommand:
    """The answer to an Exclusive producer that comes back with topic epoch ``epoch`` (as a
    client does that was cut off while it held the topic)."""
    host, port = (broker.pulsar_url or "").removeprefix("pulsar://").rsplit(":", 1)
    frames = [command_frame(api.BaseCommand(
        type=api.BaseCommand.CONNECT, connect=api.CommandConnect(client_version="t",
                                                                 protocol_version=20))),
              command_frame(api.BaseCommand(type=api.BaseCommand.PRODUCER,
                                            producer=api.CommandProducer(
                                                topic=NAME, producer_id=1, request_id=1,
                                                producer_name="zombie",
                                                producer_access_mode=1, topic_epoch=epoch)))]
    kinds = (api.BaseCommand.PRODUCER_SUCCESS, api.BaseCommand.ERROR)
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(b"".join(frames))
        got = commands_until(sock, lambda cs: any(c.type in kinds for c in cs))
    return next(c for c in got if c.type in kinds)


def test_a_producer_that_lost_the_topic_is_fenced_after_a_broker_restart(
        start_broker: Any, free_port: int) -> None:
    """Regression: topic epochs lived in the broker's memory, so an exclusive producer cut off
    while another held the topic, across a broker restart, took it back when it returned.
    They are kept in the metadata store now, as Pulsar keeps them in the topic's."""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = client_of(broker)
    try:
        for name in ("zombie", "successor"):  # epochs 0, then 1
            producer = _producer(client, Mode.Exclusive, name)
            producer.send(name.encode())
            producer.close()
    finally:
        client.close()
    broker.kill()
    broker = start_broker("--pulsar-port", str(free_port))
    answer = _returning_producer(broker, epoch=0)
    assert answer.type == api.BaseCommand.ERROR, answer
    assert answer.error.error == api.ProducerFenced and "epoch 1" in answer.error.message
    assert _returning_producer(broker, epoch=1).type == api.BaseCommand.PRODUCER_SUCCESS
