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
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pulsar
import pyarrow as pa

from bench.harness import (
    Figure,
    ProcessCpu,
    WorkerProcess,
    cost_figures,
    cpu_seconds,
    free_port,
    loop_unit_us,
    repeat,
    report,
    sized,
    timed,
)
from tierstream.broker.config import StoreConfig
from tierstream.broker.process import BrokerProcess
from tierstream.broker.pulsar.produce import off_hash
from tierstream.broker.store import Store
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.message_format import as_produce_batch
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import (
    command_frame,
    parse_frame,
    payload_frame,
    read_frame_size,
)
from tierstream.pulsar_protocol.messages import to_rows

VALUE = b"v" * 100
BATCH = 1000


def _pulsar_rate(client: Any, topic: str, messages: int, cpu: list[ProcessCpu],
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

    with ProcessCpu(_pid(broker)) as used:
        rate = messages / timed(send)
    cpu.append(used)
    producer.close()
    return rate


class _Replay:
    """Pulsar SENDs as the client above makes them (batches of BATCH unkeyed VALUEs, sequence
    ids counting up), encoded before the clock starts and written to the broker by a socket
    that costs this process next to nothing: the broker's CPU per message without the real
    client's ~6.6 us per message beside it on the same two cores. Its load on the shared
    caches and memory slows the broker, the Pulsar path most (it touches more bytes: the
    frames, then per message a properties map): with a memory-bound numpy loop on the other
    core the replayed path went from 1.4 to 2.4 us per message, tierstream's own from 1.0 to
    1.4 (measured 2026-11-27); a loop that only spins changed neither."""

    def __init__(self, pulsar_url: str, topic: str) -> None:
        host, port = pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(command_frame(api.BaseCommand(
            type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
                client_version="bench", protocol_version=20))) + command_frame(api.BaseCommand(
                    type=api.BaseCommand.PRODUCER, producer=api.CommandProducer(
                        topic=topic, producer_id=1, request_id=1, producer_name="bench"))))
        self._until(lambda c: c.type == api.BaseCommand.PRODUCER_SUCCESS)
        self.next_id = 0

    def _until(self, done: Any, count: int = 1) -> None:
        seen = 0
        while seen < count:
            head = self._read(4)
            command = parse_frame(self._read(read_frame_size(head))).command
            if command.type == api.BaseCommand.SEND_ERROR:
                raise RuntimeError(f"the broker refused a send: {command.send_error.message}")
            seen += bool(done(command))

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise RuntimeError("the broker closed the connection")
            data += chunk
        return data

    def frames(self, messages: int) -> list[bytes]:
        out = []
        for first in range(self.next_id, self.next_id + messages, BATCH):
            metadata, data = _batch(first=first)
            metadata.publish_time = int(time.time() * 1000)
            send = api.BaseCommand(type=api.BaseCommand.SEND, send=api.CommandSend(
                producer_id=1, sequence_id=first, highest_sequence_id=first + BATCH - 1,
                num_messages=BATCH))
            out.append(payload_frame(send, metadata, data))
        self.next_id += messages
        return out

    def rate(self, broker: BrokerProcess, messages: int, cpu: list[ProcessCpu]) -> float:
        frames = self.frames(messages)

        def send() -> None:
            writer = threading.Thread(target=lambda: [self.sock.sendall(f) for f in frames])
            writer.start()  # receipts read meanwhile: nothing waits on a full socket buffer
            self._until(lambda c: c.type == api.BaseCommand.SEND_RECEIPT, len(frames))
            writer.join()

        with ProcessCpu(_pid(broker)) as used:
            rate = messages / timed(send)
        cpu.append(used)
        return rate


def _own_rate(broker: BrokerProcess, topic: str, messages: int, cpu: list[ProcessCpu]) -> float:
    with Producer(topic, broker=broker.url, batch_size=BATCH, max_in_flight=16) as producer:
        def send() -> None:
            producer.send_many({"value": VALUE} for _ in range(messages))
            producer.flush()
        with ProcessCpu(_pid(broker)) as used:
            rate = messages / timed(send)
    cpu.append(used)
    return rate


def _pid(broker: BrokerProcess) -> int:
    assert broker.proc is not None
    return broker.proc.pid


def _per_message_us(cpu: list[ProcessCpu], messages: int, side: str, runs: int) -> list[float]:
    return [getattr(c, side) / messages * 1e6 for c in cpu[-runs:]]  # not the warm-up


def _batch(key: str | None = None, first: int | None = None
           ) -> tuple[api.MessageMetadata, bytes]:
    """A Pulsar batch of BATCH messages of VALUE (each with ``key``), as a client sends it:
    its metadata and payload. Sequence ids count up from ``first``, as a client numbers them;
    all 0 without it."""
    single = api.SingleMessageMetadata(payload_size=len(VALUE), sequence_id=0)
    if key is not None:
        single.partition_key = key
    parts = []
    for i in range(BATCH):
        if first is not None:
            single.sequence_id = first + i
        parts.append(len(m := single.SerializeToString()).to_bytes(4, "big") + m + VALUE)
    return api.MessageMetadata(producer_name="bench", sequence_id=first or 0, publish_time=1,
                               num_messages_in_batch=BATCH), b"".join(parts)


def _decode_rate(messages: int) -> float:
    """The broker's decode of Pulsar batches alone: ``to_rows`` over batches of 1,000."""
    metadata, data = _batch()

    def decode() -> None:
        for i in range(messages // BATCH):
            to_rows(metadata, data, sequence_id=i * BATCH)
    return messages / timed(decode)


def _step_us(messages: int, tmp: str) -> dict[str, float]:
    """CPU per message (us) of the broker's steps on a keyed SEND of a batch of 1,000
    100-byte messages, each alone in this process: the frame's parse with its checksum, the
    batch's decode into rows, the check of where tierstream's hash puts each key, and the
    append of the rows (the entry built and written by the bookie, fsync off: CPU, not the
    disk) beside the append of the rows tierstream's own producer sends for the same
    messages."""
    metadata, data = _batch(key="user-123")
    send = api.BaseCommand(type=api.BaseCommand.SEND,
                           send=api.CommandSend(producer_id=1, sequence_id=0,
                                                num_messages=BATCH))
    body = payload_frame(send, metadata, data)[4:]  # what follows the frame's size
    rows = to_rows(metadata, data, sequence_id=0)
    own = as_produce_batch(pa.record_batch({"key": ["user-123"] * BATCH,
                                            "value": [VALUE] * BATCH}))
    batches = max(1, messages // BATCH)
    store = Store(StoreConfig.from_options({"dataDir": tempfile.mkdtemp(dir=tmp),
                                            "fsync": False}))
    store.create_topic("bench/steps/pulsar", 1)
    store.create_topic("bench/steps/own", 1)
    pulsar_log, own_log = (store.partition("bench/steps/pulsar", 0),
                           store.partition("bench/steps/own", 0))

    def per_message(step: Any) -> float:
        start = time.process_time()  # every thread of this process: the bookie's too
        for _ in range(batches):
            step()
        return (time.process_time() - start) / (batches * BATCH) * 1e6

    try:
        return {"frame parse + checksum": per_message(lambda: parse_frame(body)),
                "batch decode into rows (to_rows)": per_message(
                    lambda: to_rows(metadata, data, sequence_id=0)),
                "key routing check (key hashes)": per_message(lambda: off_hash(rows, 0, 4)),
                "append (entry built, bookie write)": per_message(
                    lambda: pulsar_log.append(rows, producer=None, sequence_id=None)),
                "  the same append of tierstream's own rows": per_message(
                    lambda: own_log.append(own, producer=None, sequence_id=None))}
    finally:
        store.close()


def pulsar_produce(quick: bool = True) -> Path:
    messages, runs = sized((200_000, 3) if quick else (1_000_000, 5), (2_000, 1))
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
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

                unit = loop_unit_us()
                for partitions in (1, 4):
                    theirs_cpu: list[ProcessCpu] = []
                    ours_cpu: list[ProcessCpu] = []
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
                    figures += cost_figures(
                        f"  Pulsar path, {partitions} partition(s)", messages,
                        theirs_cpu[-runs:], unit,
                        baseline=("tierstream's own path", ours_cpu[-runs:]))
                    if partitions == 1:  # the broker's cost alone: the client's load taken off
                        replay_cpu: list[ProcessCpu] = []
                        replay = _Replay(broker.pulsar_url, f"persistent://{topic('replay', 1)}")
                        repeat(lambda r=replay, c=replay_cpu: r.rate(broker, messages, c), runs)
                        replay.sock.close()
                        figures.append(Figure(
                            "  broker CPU per message, Pulsar SENDs replayed (no client load "
                            "beside), 1 partition", "us",
                            _per_message_us(replay_cpu, messages, "broker", runs),
                            "tierstream's own path",
                            _per_message_us(ours_cpu, messages, "broker", runs),
                            aim="<= 1.5x tierstream's own path",
                            aim_check=lambda v, r: r is not None and r <= 1.5,
                            higher_is_better=False))
            finally:
                client.close()
        finally:
            broker.stop()
    decode = repeat(lambda: _decode_rate(messages), runs)
    figures.append(Figure("broker decode of Pulsar batches into Arrow rows (to_rows)",
                          "msg/s", decode))
    with tempfile.TemporaryDirectory() as tmp:
        steps = [_step_us(messages, tmp) for _ in range(runs)]
    for name in steps[0]:
        figures.append(Figure(f"  broker step alone: {name}, keyed batches of 1,000", "us",
                              [st[name] for st in steps], higher_is_better=False))
    return report("pulsar-produce", figures, {"messages": messages, "runs": runs,
                                              "batch": BATCH, "value_bytes": len(VALUE),
                                              "fsync": True})


# -- consume ---------------------------------------------------------------------------------

CONSUME_TOPIC = "bench/pulsar/orders"
CONSUME_PARTITIONS = 4
_PULSAR_TYPES = {"exclusive": "Exclusive", "shared": "Shared", "key_shared": "KeyShared"}


def _drain_rate(kind: str, urls: tuple[str, str], mode: str, n: int, messages: int,
                run: int, used: ProcessCpu) -> float:
    """Messages/s of ``n`` ``kind`` consumers draining a new ``mode`` subscription; ``used``
    gets the broker's CPU over the drain and, as the client's, the consumers' together."""
    subscription = f"{kind}-{mode}-{run}"
    url = urls[0] if kind == "own" else urls[1]
    # each consumer a process: it attaches when told go, receives and acknowledges until
    # nothing came for a second, then says how many and when its last ack returned
    workers = [WorkerProcess("bench.pulsar_bench", [kind, url, subscription, mode,
                                                    f"{subscription}-{i}"],
                             f"{subscription}-{i}", timeout=300) for i in range(n)]
    with used:
        for w in workers:
            w.tell("go")
        results = WorkerProcess.drain_results(workers)
    used.client = sum(r["cpu"] for r in results)
    got = sum(r["messages"] for r in results)
    if got != messages:
        raise RuntimeError(f"{kind} {mode}: {got} of {messages} messages received")
    seconds = max(r["last"] for r in results if r["last"]) - min(r["go"] for r in results)
    return messages / seconds


def pulsar_consume(quick: bool = True) -> Path:
    """Real-client consumers (1 exclusive; 4 shared; 4 key_shared, each a process) receive
    and acknowledge every message, beside tierstream's own Consumer on the same messages."""
    messages, runs = sized((100_000, 3) if quick else (400_000, 5), (2_000, 1))
    rates: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[ProcessCpu]] = {}
    unit = loop_unit_us()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = BrokerProcess(Path(tmp) / "data", args=["--pulsar-port", str(port)]).start()
        try:
            assert broker.url is not None and broker.pulsar_url is not None
            with Admin(broker.url) as admin:
                admin.create_topic(CONSUME_TOPIC, CONSUME_PARTITIONS)
            with Producer(CONSUME_TOPIC, broker=broker.url, max_in_flight=16) as producer:
                producer.send_many({"key": f"user-{i * 7919 % 1000}", "value": VALUE}
                                   for i in range(messages))
            for run in range(runs):  # interleaved, so drift hits each alike
                for mode, n in (("exclusive", 1), ("shared", sized(4, 2)),
                                ("key_shared", sized(4, 2))):
                    for kind in ("pulsar", "own"):
                        cpu.setdefault((kind, mode), []).append(ProcessCpu(_pid(broker)))
                        rates.setdefault((kind, mode), []).append(_drain_rate(
                            kind, (broker.url, broker.pulsar_url), mode, n, messages, run,
                            cpu[(kind, mode)][-1]))
            scaling = _key_shared_scaling(broker, sized(6_000, 600), runs)
            large = _key_shared_scaling(broker, sized(60_000, 1_200), runs, ("backlog",))
        finally:
            broker.stop()
    figures = [Figure(f"Pulsar client: {'1 exclusive' if mode == 'exclusive' else '4 ' + mode}"
                      " consumer(s), receive + ack", "msg/s", rates[("pulsar", mode)],
                      "tierstream Consumer, same", rates[("own", mode)],
                      aim=">= 0.8 of tierstream's own consumer",
                      aim_check=lambda v, r: r is not None and r >= 0.8)
               for mode in ("exclusive", "shared", "key_shared")]
    for mode in ("exclusive", "key_shared"):
        figures += cost_figures(f"Pulsar client, {mode}", messages, cpu[("pulsar", mode)],
                                unit, baseline=("tierstream Consumer", cpu[("own", mode)]))
    for how in ("backlog", "live"):
        figures.append(Figure(
            f"3 Pulsar Key_Shared consumers, a thread each, joining one after another: "
            f"{sized(6_000, 600):,} mixed-key messages, {how}", "msg/s", scaling[(3, how)],
            "1 consumer, same", scaling[(1, how)], aim=">= 0.5 of one consumer",
            aim_check=lambda v, r: r is not None and r >= 0.5))
    # What bounds the small backlog's figure: a consumer that joins takes the keys whose
    # range moved to it only once the consumer that had them acknowledged what it was sent
    # (PIP-379), and the client sends acknowledgements every 100 ms (pulsar-client-cpp's
    # ackGroupingTimeMs, not settable from Python): each of the two joins waits 0..100 ms,
    # 50 ms on average, whatever the broker does. The figure beside: 1 consumer's drain time
    # plus that average wait per join.
    one = scaling[(1, "backlog")]
    figures.append(Figure(
        f"what the joins leave of the {sized(6_000, 600):,}-message backlog figure above: 1 "
        "consumer's drain time + 2 joins x 50 ms (the mean wait for the client's 100 ms "
        "acknowledgement grouping)", "msg/s",
        [sized(6_000, 600) / (sized(6_000, 600) / r + 2 * _ACK_GROUPING_S / 2)
         for r in one],
        "1 consumer, same", one, aim="(about the ratio the figure above can reach)"))
    figures.append(Figure(
        f"3 Pulsar Key_Shared consumers, joining one after another: {sized(60_000, 1_200):,} "
        "mixed-key messages, backlog (the joins' waits spread thin)", "msg/s",
        large[(3, "backlog")], "1 consumer, same", large[(1, "backlog")],
        aim=">= 0.5 of one consumer", aim_check=lambda v, r: r is not None and r >= 0.5))
    return report("pulsar-consume", figures, {"messages": messages, "runs": runs,
                                              "partitions": CONSUME_PARTITIONS,
                                              "value_bytes": len(VALUE)})


#: the key_shared scaling topics' numbers, unique across calls (one broker serves them all)
_TOPIC_NAMES = itertools.count()
#: pulsar-client-cpp's default ackGroupingTimeMs, which the Python client does not expose
_ACK_GROUPING_S = 0.1


def _key_shared_scaling(broker: BrokerProcess, messages: int, runs: int,
                        hows: tuple[str, ...] = ("backlog", "live")
                        ) -> dict[tuple[int, str], list[float]]:
    """msg/s of 1 and of 3 real-client Key_Shared consumers (a thread each, subscribing one
    after another, receiving and acknowledging each message) draining ``messages`` of 151
    keys written by tierstream's Producer in mixed-key batches of 100: already there
    (backlog), or written once the consumers joined (live). Interleaved runs."""
    out: dict[tuple[int, str], list[float]] = {}
    for _ in range(max(1, runs)):
        for how in hows:
            for n in (1, 3):
                topic = f"bench/pulsar/ks-scaling-{next(_TOPIC_NAMES)}"
                out.setdefault((n, how), []).append(
                    _key_shared_drain(broker, topic, n, how, messages))
    return out


def _key_shared_drain(broker: BrokerProcess, topic: str, n: int, how: str, messages: int
                      ) -> float:
    """One run of :func:`_key_shared_scaling`: msg/s."""
    assert broker.url is not None and broker.pulsar_url is not None
    url = broker.url
    with Admin(url) as admin:
        admin.create_topic(topic, 1)

    def write() -> None:
        with Producer(topic, broker=url, batch_size=100) as producer:
            producer.send_many({"key": f"k{i % 151}", "value": VALUE} for i in range(messages))

    if how == "backlog":
        write()
    client = pulsar.Client(broker.pulsar_url,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    got, done, lock = [0], threading.Event(), threading.Lock()

    def drain(consumer: Any) -> None:
        while not done.is_set():
            try:
                msg = consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            consumer.acknowledge(msg)
            with lock:
                got[0] += 1
                if got[0] >= messages:
                    done.set()

    started = time.monotonic()
    threads = []
    try:
        for i in range(n):
            consumer = client.subscribe(f"persistent://{topic}", "ks", consumer_name=f"c{i}",
                                        consumer_type=pulsar.ConsumerType.KeyShared,
                                        initial_position=pulsar.InitialPosition.Earliest)
            threads.append(threading.Thread(target=drain, args=(consumer,)))
            threads[-1].start()
        if how == "live":
            started = time.monotonic()
            write()
        if not done.wait(300):
            raise RuntimeError(f"{n} Key_Shared consumer(s), {how}: {got[0]} of {messages} "
                               "in 300 s")
        return messages / (time.monotonic() - started)
    finally:
        done.set()
        for t in threads:
            t.join()
        client.close()


def _worker(kind: str, url: str, subscription: str, mode: str, name: str) -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    go, cpu = time.monotonic(), cpu_seconds()
    n, last = 0, None
    drained = threading.Event()  # another consumer saw the topic go idle

    def hear() -> None:
        if sys.stdin.readline().strip() == "drained":
            drained.set()

    threading.Thread(target=hear, daemon=True).start()

    def first_wait_over() -> bool:
        return drained.is_set() or time.monotonic() - go > 30

    if kind == "pulsar":
        client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        consumer = client.subscribe(
            f"persistent://{CONSUME_TOPIC}", subscription, consumer_name=name,
            consumer_type=getattr(pulsar.ConsumerType, _PULSAR_TYPES[mode]),
            initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=1000)
        while True:
            try:
                msg = consumer.receive(timeout_millis=1000)
            except pulsar.Timeout:
                if n or first_wait_over():
                    break
                continue
            consumer.acknowledge(msg)
            n += 1
            last = time.monotonic()
        consumer.close()  # sends the acks still grouped
        client.close()
    else:
        with Consumer(CONSUME_TOPIC, subscription, mode=mode, consumer_name=name, broker=url,
                      initial=Offset.earliest()) as ours:
            while True:
                if (batch := ours.receive(timeout=1.0)) is None:
                    if n or first_wait_over():
                        break
                    continue
                ours.ack(batch)
                n += batch.num_rows
                last = time.monotonic()
    print(json.dumps({"messages": n, "go": go, "last": last, "cpu": cpu_seconds() - cpu}),
          flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(*sys.argv[2:7])
