"""``python -m bench metadata``: the metadata operations on the hot paths, on PostgreSQL beside
SQLite in the same run, and produce / consume through a broker on each.

- a segment roll: seal a segment (final stats and 10 producers' de-dup state) and open the
  next, one transaction each, as ``PartitionLog._roll`` does;
- an ack flush: 100 cursors stored in one transaction (``CursorWriter``);
- a de-dup save of 100 producers (inside a seal);
- planning: ``segments_in_windows`` over every partition of a topic of P partitions x S
  segments for a window of 10% of its time (quick: 100 x 1,000; ``--full``: 1,000 x 1,000);
- produce msg/s (``Producer.send_many``, fsync on) and consume msg/s (a ``Consumer``
  receiving and acknowledging batches) through a broker process on each backend;
- produce msg/s while PostgreSQL is stopped, beside the same producer just before: appends
  between two segment rolls need no metadata, and must not wait for it.

PostgreSQL is a local server started for the run (``tests/postgres.py``: initdb into a
temporary directory, loopback, fsync on), so the figure is the engine's cost, not a
network's: a server on another host adds its round trip to each transaction.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import Figure, report, sized
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.metadata.records import SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.model.positions import Offset

VALUE = b"x" * 100


def metadata(quick: bool) -> Path:
    from tests.postgres import PostgresServer

    partitions, segments = sized((100, 1000) if quick else (1000, 1000), (5, 50))
    ops, messages = sized((200, 100_000) if quick else (400, 200_000), (10, 1_000))
    server = PostgresServer(fsync=True)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for backend in ("sqlite", "postgresql"):
                where: Any = Path(tmp) / "metadata.db" if backend == "sqlite" \
                    else server.new_database()
                results[backend] = _operations(where, ops, partitions, segments)
                url = None if backend == "sqlite" else server.new_database()
                results[backend].update(_through_broker(Path(tmp) / f"{backend}-data", url,
                                                        messages))
            outage = _through_outage(server, Path(tmp) / "outage-data", sized(3.0, 0.5))
    finally:
        server.stop()
    names = {"roll": ("segment roll (seal + open)", "ops/s"),
             "acks": ("ack flush of 100 cursors", "flushes/s"),
             "dedup": ("de-dup save of 100 producers", "saves/s"),
             "plan": (f"plan a 10% window of {partitions} x {segments} segments", "plans/s"),
             "produce": ("produce through the broker", "msg/s"),
             "consume": ("consume + ack through the broker", "msg/s")}
    figures = []
    for key, (label, unit) in names.items():
        aim, check = "", None
        if key in ("produce", "consume"):
            aim = ">= 0.9 of SQLite's"
            check = _at_least(0.9)
        figures.append(Figure(f"PostgreSQL: {label}", unit, results["postgresql"][key],
                              "SQLite, same", results["sqlite"][key], aim=aim, aim_check=check))
    figures.append(Figure("PostgreSQL stopped: produce through the broker", "msg/s",
                          outage["during"], "the same producer before", outage["before"],
                          aim=">= 0.9 of before", aim_check=_at_least(0.9)))
    return report("metadata", figures, {"partitions": partitions, "segments": segments,
                                        "ops": ops, "messages": messages})


def _at_least(ratio: float) -> Callable[[float, float | None], bool]:
    return lambda _value, r: r is not None and r >= ratio


def _rate(n: int, fn: Callable[[int], None]) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - start)


def _operations(where: Any, ops: int, partitions: int, segments: int
                ) -> dict[str, list[float]]:
    store = MetadataStore(where)
    try:
        name = "bench/meta/rolls"
        _, (first,) = store.create_topic(TopicName.parse(name), 1, created_at=1,
                                         ensembles=[("bookie-0",)])
        current = [first]
        ten = {f"producer-{i}": (i, {"at": [1, 2, 3]}) for i in range(10)}
        hundred = {f"producer-{i}": (i, {"at": [1, 2, 3]}) for i in range(100)}

        def roll(i: int) -> None:
            sealed = current[0].with_stats(state=SegmentState.CLOSED, entries=100,
                                           messages=10_000, bytes=1 << 20,
                                           min_publish_time=i * 10, max_publish_time=i * 10 + 9,
                                           sealed_at=i)
            store.seal_segment(sealed, ten)
            current[0] = store.new_segment(name, 0, ensemble=("bookie-0",), created_at=i)

        def acks(i: int) -> None:
            store.save_cursors([(name, f"sub-{j}", 0, {"mark_delete": [i, j, 0], "acked": []})
                                for j in range(100)], now=i)

        def dedup(i: int) -> None:
            sealed = current[0].with_stats(state=SegmentState.OPEN, entries=i)
            store.seal_segment(sealed, hundred)

        out = {"roll": [], "acks": [], "dedup": [], "plan": []}  # type: dict[str, list[float]]
        for _ in range(3):
            out["roll"].append(_rate(ops, roll))
            out["acks"].append(_rate(ops, acks))
            out["dedup"].append(_rate(ops, dedup))
        _fill(store, "bench/meta/plan", partitions, segments)
        t0, t1 = int(segments * 0.45) * 1000, int(segments * 0.55) * 1000
        for _ in range(3):
            out["plan"].append(_rate(5, lambda _i: store.segments_in_windows(
                "bench/meta/plan", range(partitions), t0, t1)))
        return out
    finally:
        store.close()


def _fill(store: MetadataStore, name: str, partitions: int, segments: int) -> None:
    """A topic of ``partitions`` x ``segments`` closed segments, one second each, written
    straight into the tables (through the backend: the same statements on both engines)."""
    store.create_topic(TopicName.parse(name), partitions, created_at=1,
                       ensembles=[("bookie-0",)] * partitions)
    ensemble = json.dumps(["bookie-0"])
    with store.atomic() as c:
        c.executemany(
            "INSERT INTO segments (topic, partition, state, entries, messages, bytes, "
            "min_publish_time, max_publish_time, created_at, sealed_at, ensemble) "
            "VALUES (?, ?, 'CLOSED', 10, 1000, 100000, ?, ?, 1, 2, ?)",
            [(name, p, s * 1000, s * 1000 + 999, ensemble)
             for p in range(partitions) for s in range(segments)])
    # as autovacuum (or the broker, when it opens the store) would before these rows count
    store.backend.refresh_statistics()


def _through_broker(data: Path, url: str | None, messages: int) -> dict[str, list[float]]:
    args = [] if url is None else ["--metadata", url]
    broker = BrokerProcess(data, args=["--max-entries-per-segment", "200", *args]).start()
    out: dict[str, list[float]] = {"produce": [], "consume": []}
    try:
        assert broker.url is not None
        with Admin(broker.url) as admin:
            admin.create_topic("bench/meta/flow", 4)
        for run in range(3):
            start = time.perf_counter()
            with Producer("bench/meta/flow", broker=broker.url, batch_size=500,
                          max_in_flight=16) as producer:
                producer.send_many({"key": f"k{i % 1000}", "value": VALUE}
                                   for i in range(messages))
            out["produce"].append(messages / (time.perf_counter() - start))
            consumer = Consumer("bench/meta/flow", f"run-{run}", broker=broker.url,
                                initial=Offset.earliest(), receiver_queue_size=5000)
            got, start = 0, time.perf_counter()
            while got < messages * (run + 1):
                batch = consumer.receive(timeout=60)
                if batch is None:
                    raise RuntimeError(f"the consumer stopped at {got:,} messages")
                consumer.ack(batch)
                got += batch.num_rows
            out["consume"].append(got / (time.perf_counter() - start))
            consumer.close()
    finally:
        broker.stop()
    return out


def _through_outage(server: Any, data: Path, seconds: float) -> dict[str, list[float]]:
    """One producer's msg/s in three windows of ``seconds`` before ``server`` stops and three
    while it is stopped (the broker's outage limit well beyond), then the server again."""
    import threading

    broker = BrokerProcess(data, args=["--metadata", server.new_database()],
                           env={"TIERSTREAM_METADATA_OUTAGE_S": "120"}).start()
    acked, stop = [0], threading.Event()

    def produce() -> None:
        with Producer("bench/meta/outage", broker=broker.url, batch_size=100,
                      send_timeout=120) as producer:
            while not stop.is_set():
                producer.send_many({"key": f"k{i}", "value": VALUE} for i in range(100))
                acked[0] += 100

    def rate() -> float:
        first, start = acked[0], time.perf_counter()
        time.sleep(seconds)
        return (acked[0] - first) / (time.perf_counter() - start)

    writer = threading.Thread(target=produce, daemon=True)
    try:
        assert broker.url is not None
        with Admin(broker.url) as admin:
            admin.create_topic("bench/meta/outage", 1)
        writer.start()
        time.sleep(seconds / 2)  # the producer under way
        before = [rate() for _ in range(3)]
        server.halt()
        try:
            during = [rate() for _ in range(3)]
        finally:
            server.resume()
        stop.set()
        writer.join(timeout=120)
    finally:
        stop.set()
        broker.stop()
    return {"before": before, "during": during}
