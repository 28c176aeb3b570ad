"""Benchmarks of the embedded store (issue 2): produce, tail latency, consume vs its ceiling.

Every figure runs against a real broker process with fsync on, beside a baseline from the
same run on the same machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from bench.harness import (
    Figure,
    ProcessCpu,
    broker_with_topic,
    console,
    cost_figures,
    cpu_of,
    loop_unit_us,
    repeat,
    report,
    save_chart,
    sized,
    switches_between,
    thread_switches,
    timed,
)
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, read
from tierstream.model.message_format import as_produce_batch
from tierstream.model.positions import Offset

VALUE = b"v" * 100


def _batch(n: int, keys: int = 100, seed: int = 0) -> pa.RecordBatch:
    return as_produce_batch(pa.record_batch({
        "key": [f"user-{(seed + i) % keys}" for i in range(n)],
        "value": [VALUE] * n,
    }))


def produce(quick: bool = True) -> Path:
    """Messages/s into one partition: 100-byte values, batches of 1,000, fsync on."""
    messages, runs = sized((300_000, 3) if quick else (2_000_000, 5), (2_000, 1))
    batch = _batch(1000)
    payload = pa.RecordBatch.from_arrays(batch.columns, schema=batch.schema).serialize()
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data").start()
        try:
            assert broker.url is not None
            with Admin(broker.url) as admin:
                admin.create_topic("bench/produce/t", 1)
            producer = Producer("bench/produce/t", broker=broker.url, name="bench",
                                max_in_flight=16)

            # one table of `messages` rows in batches of 1,000: send_batch pipelines them
            # (up to max_in_flight unacknowledged) and waits for the last ack
            table = pa.Table.from_batches([batch] * (messages // 1000))

            assert broker.proc is not None
            pid, cpus = broker.proc.pid, list[ProcessCpu]()

            switches: list[float] = []  # the broker's threads', per batch of 1,000

            def run() -> float:
                before = thread_switches(pid)
                with ProcessCpu(pid) as used:
                    rate = messages / timed(lambda: producer.send_batch(table, partition=0))
                switches.append(switches_between(before, thread_switches(pid))
                                / (messages // 1000))
                cpus.append(used)
                return rate

            tput = repeat(run, runs)
            unit = loop_unit_us()
            producer.close()
            with Admin(broker.url) as admin:
                admin.create_topic("bench/produce/four", 4)
            fours = [Producer("bench/produce/four", broker=broker.url, name=f"bench-{p}",
                              max_in_flight=16) for p in range(4)]

            def run_four() -> float:
                """4 producers, each on its own partition and thread, all at once."""
                def send(p: int) -> None:
                    fours[p].send_batch(table, partition=p)
                threads = [threading.Thread(target=send, args=(p,)) for p in range(4)]

                def all_four() -> None:
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                return 4 * messages / timed(all_four)

            tput_four = repeat(run_four, runs)
            for producer in fours:
                producer.close()
        finally:
            broker.stop()

        disk_cpu: list[float] = []

        def disk() -> float:
            # The disk's own ceiling: the same entry bytes appended and fdatasync'd per batch.
            path = Path(tmp) / "ceiling.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                def write() -> None:
                    for _ in range(messages // 1000):
                        os.write(fd, payload)
                        os.fdatasync(fd)
                seconds, cpu = cpu_of(write)
                disk_cpu.append(cpu)
                return messages / seconds
            finally:
                os.close(fd)
                path.unlink()

        ceiling = repeat(disk, runs)
    floor_cpu, floor_switches = _transport_floor_cpu(batch, messages, runs)
    mb = [t * 100 / 1e6 for t in tput]
    figures = [
        Figure("produce msg/s (1 partition, 100 B, batch 1000, fsync)", "msg/s", tput,
               "append+fdatasync of the same bytes", ceiling,
               aim=">= 500,000 msg/s, ratio >= 0.5",
               aim_check=lambda v, r: v >= 500_000 and r is not None and r >= 0.5),
        Figure("produce value MB/s", "MB/s", mb),
        Figure("produce msg/s, 4 partitions x 4 producers (aggregate)", "msg/s", tput_four,
               "append+fdatasync of the same bytes", ceiling),
        *cost_figures("produce, 1 partition", messages, cpus[-runs:], unit),
        # what any durable produce over Flight pays, beside the broker's figure above
        Figure("  floor: append + fdatasync of the same bytes, CPU per message (what the "
               "disk costs any durable produce)",
               "us", [c / messages * 1e6 for c in disk_cpu[-runs:]], higher_is_better=False),
        Figure("  floor: a bare Flight server in Python reading the same batches and acking "
               "each, CPU per message (what the transport costs)", "us",
               [c / messages * 1e6 for c in floor_cpu], higher_is_better=False),
        # threads handing a batch on to each other: the kernel's part above
        Figure("produce, 1 partition: the broker's threads' context switches per batch of "
               "1,000", "switches", switches[-runs:], "the bare Flight server's",
               floor_switches, higher_is_better=False),
    ]
    return report("produce", figures, {"messages": messages, "runs": runs, "batch": 1000,
                                       "value_bytes": 100, "fsync": True})


def _transport_floor_cpu(batch: pa.RecordBatch, messages: int, runs: int
                         ) -> tuple[list[float], list[float]]:
    """CPU seconds of the bare Flight server (``bench/transport_floor.py``) taking
    ``messages`` rows as ``batch`` after batch, acking each, and its threads' context
    switches per batch: one figure of each per run."""
    from bench.transport_floor import FloorProcess, floor_produce

    batches = messages // batch.num_rows
    used: list[float] = []
    switches: list[float] = []
    with FloorProcess(batch.num_rows) as floor:
        floor_produce(floor.url, batch, max(1, batches // 10))  # warm
        for _ in range(runs):
            before = thread_switches(floor.pid)
            with ProcessCpu(floor.pid) as cpu:
                floor_produce(floor.url, batch, batches)
            switches.append(switches_between(before, thread_switches(floor.pid)) / batches)
            used.append(cpu.broker)
    return used, switches


def tail(quick: bool = True) -> Path:
    """Produce -> consumer latency at a steady 10,000 msg/s: p50 and p99 (3 runs)."""
    seconds, runs = sized((3 if quick else 20, 3), (1, 1))
    rate = 10_000
    per_batch = 50  # 200 batches/s
    ping_ms: list[float] = []
    per_run: list[list[float]] = []
    with broker_with_topic("bench/tail/t", 1) as broker:
        url = broker.url
        with Admin(url) as admin:
            for _ in range(200):
                t0 = time.perf_counter()
                admin.ping()
                ping_ms.append((time.perf_counter() - t0) * 1000)
        for run in range(runs + 1):  # the first run warms up
            lat = _tail_run(url, rate, per_batch, seconds, offset=run * rate * seconds)
            if run:
                per_run.append(sorted(lat))

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    pings = sorted(ping_ms)
    figures = [
        Figure("tail latency p50 at 10k msg/s", "ms", [pct(r, 0.50) for r in per_run],
               "admin ping p50", [pct(pings, 0.50)], higher_is_better=False),
        Figure("tail latency p99 at 10k msg/s", "ms", [pct(r, 0.99) for r in per_run],
               "admin ping p99", [pct(pings, 0.99)], aim="p99 <= 20 ms",
               higher_is_better=False, aim_check=lambda v, r: v <= 20),
        Figure("tail latency max", "ms", [r[-1] for r in per_run], higher_is_better=False),
    ]
    lat = sorted(x for r in per_run for x in r)

    def draw(ax: Any) -> None:
        ax.hist(lat, bins=100, color="#3b6ea5")
        ax.axvline(pct(lat, 0.99), color="red", linestyle="--", label="p99")
        ax.set_xlabel("produce -> consume latency (ms)")
        ax.set_ylabel("messages")
        ax.set_title(f"tail latency at {rate:,} msg/s ({len(lat):,} messages, {runs} runs)")
        ax.legend()

    save_chart("tail", draw)
    return report("tail", figures, {"rate": rate, "seconds": seconds, "batch": per_batch,
                                    "runs": runs},
                  {"latency_ms_sample": lat[:: max(1, len(lat) // 2000)]})


def _tail_run(url: str, rate: int, per_batch: int, seconds: int, offset: int) -> list[float]:
    """One run: a paced producer and a tail reader in this process; per-message latency."""
    latencies_ms: list[float] = []
    stream = read("bench/tail/t", broker=url, start=Offset.latest())
    sent_at: dict[int, float] = {}
    done = threading.Event()
    total = rate * seconds

    def consume() -> None:
        seen = 0
        for b in stream:
            now = time.perf_counter()
            for v in b.column("value").to_pylist():
                latencies_ms.append((now - sent_at[int(v)]) * 1000)
            seen += b.num_rows
            if seen >= total:
                break
        done.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    with Producer("bench/tail/t", broker=url, max_in_flight=1) as producer:
        start = time.perf_counter()
        for i in range(total // per_batch):
            due = start + i * per_batch / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # pacing the load, not synchronisation
            ids = range(offset + i * per_batch, offset + (i + 1) * per_batch)
            batch = pa.record_batch({"value": [str(j).encode() for j in ids]})
            now = time.perf_counter()
            for j in ids:
                sent_at[j] = now
            producer.send_batch(batch, partition=0)
    if not done.wait(60):
        raise RuntimeError("tail consumer did not receive every message within 60 s")
    stream.close()
    return latencies_ms


def consume(quick: bool = True) -> Path:
    """Consume msg/s through the broker beside the Flight transport serving the same batches
    from memory (its ceiling), as a ratio."""
    # the transport ceiling is noisy on 2 cores: more runs
    messages, runs = sized((1_000_000, 7) if quick else (5_000_000, 11), (2_000, 1))
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data").start()
        ceiling_proc = None
        try:
            url = broker.url
            assert url is not None
            with Admin(url) as admin:
                admin.create_topic("bench/consume/t", 1)
            with Producer("bench/consume/t", broker=url, max_in_flight=16) as producer:
                producer.send_batch(pa.Table.from_batches(
                    [_batch(1000, seed=i) for i in range(messages // 1000)]), partition=0)
            ceiling_proc = subprocess.Popen(
                [sys.executable, "-m", "bench.flight_ceiling", "--broker", url, "--topic",
                 "bench/consume/t"], stdout=subprocess.PIPE, text=True,
                cwd=Path(__file__).parent.parent)
            assert ceiling_proc.stdout is not None
            line = ceiling_proc.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"ceiling server did not start: {line!r}")
            ceiling_url = line.split()[-1]

            assert broker.proc is not None
            pid, cpus = broker.proc.pid, list[ProcessCpu]()

            def via_broker() -> float:
                n = 0

                def go() -> None:
                    nonlocal n
                    for b in read("bench/consume/t", broker=url, end=Offset.latest()):
                        n += b.num_rows
                with ProcessCpu(pid) as used:
                    rate = messages / timed(go)
                cpus.append(used)
                assert n == messages, f"read {n} of {messages}"
                return rate

            client = flight.FlightClient(ceiling_url)

            def via_ceiling() -> float:
                def go() -> None:
                    for _ in client.do_get(flight.Ticket(b"all")):
                        pass
                return messages / timed(go)

            ours, ceiling = [], []
            via_broker(), via_ceiling()  # warm-up, both
            for _ in range(runs):  # interleaved, so drift hits both alike
                ours.append(via_broker())
                ceiling.append(via_ceiling())
        finally:
            if ceiling_proc is not None:
                ceiling_proc.terminate()
                ceiling_proc.wait()
            broker.stop()
    figures = [Figure("consume msg/s through the broker", "msg/s", ours,
                      "Flight from memory", ceiling, aim="ratio >= 0.7",
                      aim_check=lambda v, r: r is not None and r >= 0.7),
               *cost_figures("consume through the broker", messages, cpus[-runs:],
                             loop_unit_us())]
    console.print(f"{messages:,} messages of 100 B values, 1 partition, entries of 1,000")
    return report("consume", figures, {"messages": messages, "runs": runs})
