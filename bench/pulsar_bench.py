"""Pulsar's wire protocol (issue 39): the real pulsar-client's async batched produce beside
tierstream's own Producer, both into the same broker process in the same run.

Both send 100-byte values without keys, in batches of 1,000, fsync on: the Pulsar client by
``send_async`` per message (its batching groups them: one SEND a batch), tierstream's Producer
by ``send_many`` (one Arrow batch a write). What the broker spends per message on the Pulsar
path (decoding a batch's ``SingleMessageMetadata`` into Arrow columns) is measured on its own,
beside the whole message rate, so the gap has a name.
"""

from __future__ import annotations

import itertools
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import pulsar

from bench.harness import Figure, repeat, report, timed
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.messages import to_rows

VALUE = b"v" * 100
BATCH = 1000


def _pulsar_rate(client: Any, topic: str, messages: int) -> float:
    producer = client.create_producer(
        topic, batching_enabled=True, batching_max_messages=BATCH,
        batching_max_allowed_size_in_bytes=4 << 20, batching_max_publish_delay_ms=5,
        max_pending_messages=20 * BATCH, max_pending_messages_across_partitions=80 * BATCH,
        block_if_queue_full=True)
    failed: list[Any] = []
    done = threading.Semaphore(0)

    def sent(result: Any, _id: Any) -> None:
        if str(result) != "Result.Ok":
            failed.append(result)
        done.release()

    def send() -> None:
        for _ in range(messages):
            producer.send_async(VALUE, sent)
        producer.flush()

    rate = messages / timed(send)
    for _ in range(messages):
        done.acquire()
    producer.close()
    assert not failed, failed[:3]
    return rate


def _own_rate(url: str, topic: str, messages: int) -> float:
    with Producer(topic, broker=url, batch_size=BATCH, max_in_flight=16) as producer:
        def send() -> None:
            producer.send_many({"value": VALUE} for _ in range(messages))
            producer.flush()
        return messages / timed(send)


def _decode_rate(messages: int) -> float:
    """The broker's decode of Pulsar batches alone: ``to_rows`` over batches of 1,000."""
    single = api.SingleMessageMetadata(payload_size=len(VALUE), sequence_id=0)
    data = b"".join(len(m := single.SerializeToString()).to_bytes(4, "big") + m + VALUE
                    for _ in range(BATCH))
    metadata = api.MessageMetadata(producer_name="bench", sequence_id=0, publish_time=1,
                                   num_messages_in_batch=BATCH)

    def decode() -> None:
        for i in range(messages // BATCH):
            to_rows(metadata, data, sequence_id=i * BATCH)
    return messages / timed(decode)


def pulsar_produce(quick: bool = True) -> Path:
    messages = 200_000 if quick else 1_000_000
    runs = 3 if quick else 5
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:  # a free port for the Pulsar listener
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        broker = BrokerProcess(Path(tmp) / "data", args=["--pulsar-port", str(port)]).start()
        try:
            assert broker.url is not None and broker.pulsar_url is not None
            client = pulsar.Client(broker.pulsar_url, io_threads=2,
                                   logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
            try:
                names = itertools.count()

                def topic(kind: str, parts: int) -> str:
                    name = f"bench/pulsar/{kind}-{parts}-{next(names)}"
                    with Admin(broker.url) as admin:
                        admin.create_topic(name, parts)
                    return name

                for partitions in (1, 4):

                    theirs = repeat(lambda p=partitions: _pulsar_rate(
                        client, f"persistent://{topic('pulsar', p)}", messages), runs)
                    ours = repeat(lambda p=partitions: _own_rate(
                        broker.url or "", topic("own", p), messages), runs)
                    figures.append(Figure(
                        f"Pulsar client async batched produce, {partitions} partition(s), "
                        "100 B", "msg/s", theirs, "tierstream Producer.send_many, same "
                        "messages", ours, aim=">= 0.8 of tierstream's own producer",
                        aim_check=lambda v, r: r is not None and r >= 0.8))
            finally:
                client.close()
        finally:
            broker.stop()
    decode = repeat(lambda: _decode_rate(messages), runs)
    figures.append(Figure("broker decode of Pulsar batches into Arrow rows (to_rows)",
                          "msg/s", decode))
    return report("pulsar-produce", figures, {"messages": messages, "runs": runs,
                                              "batch": BATCH, "value_bytes": len(VALUE),
                                              "fsync": True})
