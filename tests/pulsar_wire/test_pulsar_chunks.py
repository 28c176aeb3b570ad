"""Chunked messages: a real pulsar-client producer with chunking on sends messages larger than
max_message_size; the broker stores each whole (one row for every tierstream reader) and a
Pulsar consumer gets it back in chunks that its client puts together."""

from __future__ import annotations

import os
import socket
from typing import Any

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame, payload_frame

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, commands_until, rows_of

MB = 1 << 20


def _id(mid: Any) -> tuple[int, int, int, int]:
    return mid.ledger_id(), mid.entry_id(), mid.partition(), mid.batch_index()


def test_messages_of_20_and_100_mb_are_stored_whole_and_delivered_in_chunks(
        pulsar_broker: BrokerProcess) -> None:
    topic = "public/default/large"
    values = [os.urandom(20 * MB), b"small", os.urandom(MB) * 100]
    client = client_of(pulsar_broker)
    try:
        producer = client.create_producer(f"persistent://{topic}", chunking_enabled=True,
                                          batching_enabled=False,
                                          send_timeout_millis=int(scaled(60) * 1000))
        receipts = [_id(producer.send(v, properties={"n": str(i)})) for i, v in
                    enumerate(values)]
        consumer = client.subscribe(f"persistent://{topic}", "big",
                                    consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        got = [consumer.receive(timeout_millis=int(scaled(30) * 1000)) for _ in values]
        for msg in got:
            consumer.acknowledge(msg)
        consumer.close()
    finally:
        client.close()
    assert [m.data() == v for m, v in zip(got, values, strict=True)] == [True] * 3
    assert [m.properties()["n"] for m in got] == ["0", "1", "2"]
    assert [_id(m.message_id()) for m in got] == receipts
    rows = rows_of(pulsar_broker, topic)  # one row per message, whole
    assert [len(r["value"]) for r in rows] == [len(v) for v in values]
    assert [r["value"] == v for r, v in zip(rows, values, strict=True)] == [True] * 3
    with Consumer(topic, "own", broker=pulsar_broker.url, initial=Offset.earliest()) as own:
        seen: list[bytes] = []
        while len(seen) < 3 and (batch := own.receive(timeout=scaled(30))) is not None:
            seen += batch.column("value").to_pylist()
            own.ack(batch)
    assert [len(v) for v in seen] == [len(v) for v in values]
    with Admin(pulsar_broker.url) as admin:
        wait_for(lambda: sum(int(r["backlog"]) for r in admin.subscriptions(topic)
                             if r["subscription"] == "big") == 0, timeout=scaled(30),
                 what="the chunked messages to be acknowledged")


def _chunk(seq: int, uuid: str, i: int, n: int, part: bytes, total: int) -> bytes:
    send = api.BaseCommand(type=api.BaseCommand.SEND, send=api.CommandSend(
        producer_id=1, sequence_id=seq, is_chunk=True))
    meta = api.MessageMetadata(producer_name="half", sequence_id=seq, publish_time=1,
                               uuid=uuid, chunk_id=i, num_chunks_from_msg=n,
                               total_chunk_msg_size=total)
    return payload_frame(send, meta, part)


def test_a_message_whose_producer_left_mid_way_is_never_stored_and_a_resent_one_is_stored_once(
        start_broker, free_port) -> None:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    topic = "public/default/halves"
    host, port = broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    hello = [command_frame(api.BaseCommand(type=api.BaseCommand.CONNECT, connect=(
                 api.CommandConnect(client_version="t", protocol_version=20)))),
             command_frame(api.BaseCommand(type=api.BaseCommand.PRODUCER, producer=(
                 api.CommandProducer(topic=topic, producer_id=1, request_id=1,
                                     producer_name="half"))))]
    part = b"p" * MB
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        # two chunks of three, then the producer is gone
        sock.sendall(b"".join(hello + [_chunk(0, "u0", i, 3, part, 3 * MB) for i in range(2)]))
        commands_until(sock, lambda cs: any(c.type == api.BaseCommand.PRODUCER_SUCCESS
                                            for c in cs))
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        # out of order: refused, nothing stored; then the whole message
        frames = [_chunk(1, "u1", 1, 2, part, 2 * MB)] + \
            [_chunk(2, "u2", i, 2, part, 2 * MB) for i in range(2)]
        sock.sendall(b"".join(hello + frames))
        got = commands_until(sock, lambda cs: sum(c.type in (
            api.BaseCommand.SEND_RECEIPT, api.BaseCommand.SEND_ERROR) for c in cs) == 3)
    answers = [c.type for c in got if c.type in (api.BaseCommand.SEND_RECEIPT,
                                                  api.BaseCommand.SEND_ERROR)]
    assert answers == [api.BaseCommand.SEND_ERROR] + [api.BaseCommand.SEND_RECEIPT] * 2
    assert [len(r["value"]) for r in rows_of(broker, topic)] == [2 * MB]

    # a chunked message sent again after a broker SIGKILL (its receipts lost): stored once
    value = os.urandom(12 * MB)
    for _ in range(2):
        client = client_of(broker)
        try:
            producer = client.create_producer(f"persistent://{topic}", producer_name="again",
                                              chunking_enabled=True, batching_enabled=False)
            producer.send(value, sequence_id=7)
        finally:
            client.close()
        broker.kill()
        broker = start_broker("--pulsar-port", str(free_port))
    assert [len(r["value"]) for r in rows_of(broker, topic)] == [2 * MB, 12 * MB]
