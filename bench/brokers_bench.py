"""``python -m bench brokers``: one store served by 1, 2 and 3 brokers at once (``broker start
--cluster``), on three network bookies and PostgreSQL on loopback, and how long a partition
takes to move when its broker is SIGKILLed.

- **Produce and consume msg/s** of a 12-partition topic placed over the brokers, one producer
  and one consumer given every broker's address; with 2 and 3 brokers beside 1 (the
  baseline), in the same run. The **CPU per message** of each broker process (user + system,
  from ``/proc``) is reported beside the totals: on this 2-core machine the brokers, the three
  bookies, PostgreSQL and the clients share two cores, so the totals cannot scale; the CPU
  per message per broker shows how the work divides.
- **Cost per message** of the cluster, produce and consume: the brokers' CPU together and the
  client's (this process), in µs and loop units, with 2 and 3 brokers beside 1. The bookies'
  and PostgreSQL's CPU is not in it (the bookies run as processes of their own).
- **Move time** (p50, p99): with 3 brokers, one producer per partition sends a batch at a
  time; a broker owning partitions is SIGKILLed, and a partition's move time is from the kill
  until the first ack of a batch sent after it. The baseline is the lease timeout, the floor of
  a move (the owner's silence). Each kill is followed by a new broker started in its place.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

from bench.harness import (
    Figure,
    ProcessCpu,
    console,
    cost_figures,
    cpu_seconds,
    loop_unit_us,
    report,
    sized,
)
from bench.remote_write_bench import _register
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset

VALUE = b"x" * 100
PARTITIONS = 12
LEASE_S = 2.0  # the shortest lease allowed: moves are measured, not waited for


def brokers(quick: bool = True) -> Path:
    from tests.network_store import BookieProcess
    from tests.postgres import PostgresServer

    messages, kills = sized((60_000, 3) if quick else (200_000, 8), (2_000, 1))
    produce: dict[int, float] = {}
    consume: dict[int, float] = {}
    cpu: dict[int, list[float]] = {}
    costs: dict[int, tuple[tuple[ProcessCpu, int], ...]] = {}  # produce, consume: all brokers
    moves: list[float] = []
    unit = loop_unit_us()
    server = PostgresServer(fsync=False)
    try:
        for n in (1, 2, 3):
            with tempfile.TemporaryDirectory() as tmp:
                url = server.new_database()
                bookies = [BookieProcess(Path(tmp) / f"bookie-{i}", url, host_label=f"h{i}")
                           .start() for i in range(3)]
                _register(url, bookies)
                running = [_broker(Path(tmp), url, i) for i in range(n)]
                try:
                    topic = f"bench/brokers/n{n}"
                    _create(running, topic)
                    produce[n], consume[n], cpu[n], costs[n] = _rates(running, topic, messages)
                    console.print(f"{n} broker(s): produce {produce[n]:,.0f} msg/s, consume "
                                  f"{consume[n]:,.0f} msg/s, CPU per message per broker "
                                  f"{', '.join(f'{c:.1f}' for c in cpu[n])} µs")
                    if n == 3:
                        moves = _moves(Path(tmp), url, running, topic, kills)
                finally:
                    for proc in running:
                        proc.kill()
                    for b in bookies:
                        b.kill()
    finally:
        server.stop()
    figures = [
        Figure(f"produce, {n} brokers", "msg/s", [produce[n]], "1 broker", [produce[1]])
        for n in (2, 3)] + [
        Figure(f"consume, {n} brokers", "msg/s", [consume[n]], "1 broker", [consume[1]])
        for n in (2, 3)] + [
        Figure(f"CPU per message per broker, {n} brokers", "µs", cpu[n], "1 broker", cpu[1],
               higher_is_better=False) for n in (2, 3)]
    for i, path in enumerate(("produce", "consume")):
        for n in (2, 3):
            (used, count), (one, one_count) = costs[n][i], costs[1][i]
            assert count == one_count  # (the same messages on every cluster)
            figures += cost_figures(f"{path}, {n} brokers", count, [used], unit,
                                    baseline=("1 broker", [one]), server="brokers'")
    if moves:
        ordered = sorted(moves)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        figures += [Figure("partition move p50 (SIGKILL -> first ack)", "s",
                           [statistics.median(moves)], "lease timeout", [LEASE_S]),
                    Figure("partition move p99", "s", [p99], "lease timeout", [LEASE_S])]
    return report("brokers", figures, {"messages": messages, "partitions": PARTITIONS,
                                       "value_bytes": len(VALUE), "kills": kills,
                                       "lease_timeout_s": LEASE_S, "bookies": 3},
                  {"moves_s": moves})


def _broker(tmp: Path, url: str, i: int) -> BrokerProcess:
    return BrokerProcess(tmp / f"broker-{i}-{time.monotonic_ns()}", args=[
        "--metadata", url, "--network-bookies", "--no-fsync", "--cluster",
        "--lease-timeout", f"{LEASE_S:g}s", "--tier-url", str(tmp / "tier"), "--tier-shared",
        "--catalog-uri", f"sqlite:///{tmp / 'catalog.db'}"]).start(timeout=120)


def _owned(proc: BrokerProcess) -> int:
    with Admin(proc.url) as admin:
        return int(admin.stats()["partitions"])


def _create(running: list[BrokerProcess], topic: str) -> None:
    """The topic, placed over the brokers, once each one serves its share."""
    with Admin(running[0].url) as admin:
        admin.create_topic(topic, PARTITIONS)
    deadline = time.monotonic() + 60
    while sum(_owned(p) for p in running) < PARTITIONS:
        if time.monotonic() > deadline:
            raise RuntimeError("the brokers did not open the topic's partitions in 60 s")
        time.sleep(0.1)


def _cpu_s(proc: BrokerProcess) -> float:
    assert proc.proc is not None
    return cpu_seconds(proc.proc.pid)


def _rates(running: list[BrokerProcess], topic: str, messages: int
           ) -> tuple[float, float, list[float], tuple[tuple[ProcessCpu, int], ...]]:
    """Produce and consume msg/s, each broker's CPU per message producing, and the CPU of
    all brokers and of this process producing and consuming, with the messages of each."""
    urls = ",".join(p.url for p in running if p.url)
    pids = [p.proc.pid for p in running if p.proc is not None]
    produced, consumed = ProcessCpu(*pids), ProcessCpu(*pids)
    with Producer(topic, broker=urls, batch_size=100) as producer:
        producer.send_many({"value": VALUE, "key": f"k{i % 64}"} for i in range(1000))
        producer.flush()  # connected to every owner, warm
        before = [_cpu_s(p) for p in running]
        start = time.perf_counter()
        with produced:
            producer.send_many({"value": VALUE, "key": f"k{i % 64}"} for i in range(messages))
            producer.flush()
        produce = messages / (time.perf_counter() - start)
        cpu = [(_cpu_s(p) - b) / messages * 1e6 for p, b in zip(running, before, strict=True)]
    got = 0
    with Consumer(topic, "bench", mode="shared", initial=Offset.earliest(),
                  broker=urls) as consumer:
        start = time.perf_counter()
        with consumed:
            while got < messages + 1000:
                batch = consumer.receive(timeout=60)
                if batch is None:
                    raise RuntimeError(f"the consumer received {got} of {messages + 1000}")
                got += batch.num_rows
                consumer.ack(batch)
        consume = got / (time.perf_counter() - start)
    return produce, consume, cpu, ((produced, messages), (consumed, got))


def _moves(tmp: Path, url: str, running: list[BrokerProcess], topic: str, kills: int
           ) -> list[float]:
    """Kill a broker owning partitions ``kills`` times under one producer per partition;
    each partition it owned gives one move time."""
    urls = ",".join(p.url for p in running if p.url)
    acks: dict[int, list[tuple[float, float]]] = {p: [] for p in range(PARTITIONS)}
    stop, errors = threading.Event(), []

    # tiny: a send every 10 ms, not back to back: twelve producers spinning (and three brokers
    # serving them) cost a check of the benchmark more CPU than the rest of it
    pause = sized(0.0, 0.01)

    def send(partition: int) -> None:
        batch = pa.record_batch({"value": [VALUE] * 10})
        try:
            with Producer(topic, broker=urls, name=f"mover-{partition}", batch_size=10,
                          send_timeout=60) as producer:
                while not stop.is_set():
                    sent = time.monotonic()
                    producer.send_batch(batch, partition=partition)
                    producer.flush()
                    acks[partition].append((sent, time.monotonic()))
                    if pause:
                        stop.wait(pause)
        except Exception as exc:  # reported once the run ends
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(p,), daemon=True)
               for p in range(PARTITIONS)]
    for t in threads:
        t.start()
    moves: list[float] = []
    try:
        time.sleep(2)
        for k in range(kills):
            # never the first broker: the producers were given the first three brokers'
            # addresses, and one of them must answer to say where a partition went
            victim = max(running[1:], key=_owned)
            with Admin(victim.url) as admin:
                owned = [p["partition"] for p in admin.topic_stats(topic, per_partition=True)
                         ["partitions"]]
            killed_at = time.monotonic()
            victim.kill()
            for p in owned:
                deadline = killed_at + 120
                while not any(s >= killed_at for s, _ in acks[p]):
                    if time.monotonic() > deadline or errors:
                        raise RuntimeError(f"partition {p} did not move: {errors}")
                    time.sleep(0.02)
                moves.append(min(a for s, a in acks[p] if s >= killed_at) - killed_at)
            console.print(f"kill {k + 1}: {len(owned)} partition(s) moved in "
                          f"{', '.join(f'{m:.2f}' for m in moves[-len(owned):])} s")
            running.remove(victim)
            running.append(_broker(tmp, url, len(running) + k))
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    if errors:
        raise RuntimeError(f"a producer failed: {errors[0]}")
    return moves
