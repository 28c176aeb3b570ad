"""Pulsar's wire protocol (issue 39): the real pulsar-client's async batched produce beside
tierstream's own Producer, both into the same broker process in the same run.

Both send 100-byte values without keys, in batches of 1,000, fsync on: the Pulsar client by
``send_async`` per message (its batching groups them: one SEND a batch), tierstream's Producer
by ``send_many`` (one Arrow batch a write). The CPU each side spends per message (this
process: the client; the broker process) is measured in the same runs, so the gap has a name;
the broker's decode of Pulsar batches into Arrow columns is also measured on its own.
"""

from __future__ import annotations

import itertools
import os
import resource
import socket
import tempfile
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


class _Cpu:
    """CPU seconds this process and the broker process spend between start and stop."""

    def __init__(self, broker: BrokerProcess) -> None:
        assert broker.proc is not None
        self.pid = broker.proc.pid

    def _now(self) -> tuple[float, float]:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        broker = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime, broker

    def __enter__(self) -> _Cpu:
        self.start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._now()
        self.client, self.broker = (end[0] - self.start[0], end[1] - self.start[1])


def _pulsar_rate(client: Any, topic: str, messages: int, cpu: list[_Cpu],
                 broker: BrokerProcess) -> float:
    """send_async without a callback: flush raises if any message failed. (A Python callback
    per message costs the client ~25 us of GIL hand-over from its I/O thread: measured at
    ~30,000 msg/s with one, ~110,000 without, the broker's CPU the same.)"""
    producer = client.create_producer(
        topic, batching_enabled=True, batching_max_messages=BATCH,
        batching_max_allowed_size_in_bytes=4 << 20, batching_max_publish_delay_ms=5,
        max_pending_messages=20 * BATCH, max_pending_messages_across_partitions=80 * BATCH,
        block_if_queue_full=True)

    def send() -> None:
        for _ in range(messages):
            producer.send_async(VALUE, None)
        producer.flush()

    with _Cpu(broker) as used:
        rate = messages / timed(send)
    cpu.append(used)
    producer.close()
    return rate


def _own_rate(broker: BrokerProcess, topic: str, messages: int, cpu: list[_Cpu]) -> float:
    with Producer(topic, broker=broker.url, batch_size=BATCH, max_in_flight=16) as producer:
        def send() -> None:
            producer.send_many({"value": VALUE} for _ in range(messages))
            producer.flush()
        with _Cpu(broker) as used:
            rate = messages / timed(send)
    cpu.append(used)
    return rate


def _per_message_us(cpu: list[_Cpu], messages: int, side: str, runs: int) -> list[float]:
    return [getattr(c, side) / messages * 1e6 for c in cpu[-runs:]]  # not the warm-up


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
                    theirs_cpu: list[_Cpu] = []
                    ours_cpu: list[_Cpu] = []
                    theirs = repeat(lambda p=partitions, c=theirs_cpu: _pulsar_rate(
                        client, f"persistent://{topic('pulsar', p)}", messages, c, broker),
                        runs)
                    ours = repeat(lambda p=partitions, c=ours_cpu: _own_rate(
                        broker, topic("own", p), messages, c), runs)
                    figures.append(Figure(
                        f"Pulsar client async batched produce, {partitions} partition(s), "
                        "100 B", "msg/s", theirs, "tierstream Producer.send_many, same "
                        "messages", ours, aim=">= 0.8 of tierstream's own producer",
                        aim_check=lambda v, r: r is not None and r >= 0.8))
                    client_us = _per_message_us(theirs_cpu, messages, "client", runs)
                    figures.append(Figure(
                        f"  the Pulsar client's own ceiling, {partitions} partition(s): "
                        "1 / its CPU per message", "msg/s", [1e6 / us for us in client_us]))
                    for side in ("broker", "client"):
                        figures.append(Figure(
                            f"  {side} CPU per message, Pulsar path, {partitions} "
                            "partition(s)", "us", _per_message_us(theirs_cpu, messages, side, runs),
                            "tierstream's own path",
                            _per_message_us(ours_cpu, messages, side, runs),
                            higher_is_better=False))
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
