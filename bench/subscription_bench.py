"""Subscriptions: what 4 ``shared`` or 4 ``key_shared`` consumers receive and acknowledge,
beside one ``exclusive`` consumer in the same run; ack calls per second and per cursor write;
and, as a consumer joins a running ``key_shared`` subscription, how long until it gets its
first message and the longest pause the others see, beside the pauses they see with no join.

Each consumer is its own process (``python -m bench.subscription_bench worker ...``): it imports
everything, says ``ready``, attaches when told ``go`` on stdin, then receives and acknowledges
each batch until it is told ``stop`` (or, with ``--drain``, until nothing came for a while), and
prints one JSON line: messages, ack calls, first and last receive time, and every receive time
(the monotonic clock is the machine's, so the processes' times compare).
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa

from bench.harness import (
    Figure,
    ProcessCpu,
    WorkerProcess,
    broker_with_topic,
    console,
    cost_figures,
    cpu_seconds,
    loop_unit_us,
    report,
    sized,
)
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.message_format import as_produce_batch
from tierstream.model.positions import Offset

TOPIC = "bench/subs/orders"
PARTITIONS = 4
VALUE = b"x" * 100


def _batch(n: int, keys: int, seed: int) -> pa.RecordBatch:
    return as_produce_batch(pa.record_batch({
        "key": [f"user-{(seed * n + i) * 7919 % keys}" for i in range(n)],
        "value": [VALUE] * n}))


def _worker_process(url: str, subscription: str, mode: str, name: str, *,
                    drain: bool) -> WorkerProcess:
    return WorkerProcess("bench.subscription_bench",
                         [url, subscription, mode, name, "1" if drain else "0"], name)


def _throughput(url: str, mode: str, n: int, messages: int, run: int, used: ProcessCpu
                ) -> tuple[float, float, float]:
    """Messages/s and ack calls/s of ``n`` consumers of a new ``mode`` subscription draining
    ``messages``, and the busiest consumer's messages over an even share. ``used`` gets the
    broker's CPU over the run and, as its client's, the consumer processes' together."""
    subscription = f"{mode}-{run}"
    workers = [_worker_process(url, subscription, mode, f"{mode}-{run}-{i}", drain=True)
               for i in range(n)]
    with used:
        for w in workers:
            w.tell("go")
        results = [w.result() for w in workers]
    used.client = sum(r["cpu"] for r in results)
    got = sum(r["messages"] for r in results)
    if got != messages:
        raise RuntimeError(f"{mode}: {got} of {messages} messages received")
    seconds = max(r["last"] for r in results if r["last"] is not None) - \
        min(r["go"] for r in results)  # from the attach on: joining is part of the work
    busiest = max(r["messages"] for r in results) / (messages / n)
    return messages / seconds, sum(r["acks"] for r in results) / seconds, busiest


def _joins(url: str, joins: int) -> tuple[list[float], list[float], list[float]]:
    """With 3 ``key_shared`` consumers reading a topic written at a steady rate, a 4th joins
    ``joins`` times (and leaves again): ms until it gets a message, the longest pause each of
    the others sees in the 2 s after the join, and the same with no join (the 2 s before)."""
    stop = threading.Event()

    def write() -> None:
        with Producer(TOPIC, broker=url, max_in_flight=8) as producer:
            seq = 0
            while not stop.is_set():
                for p in range(PARTITIONS):  # 20,000 msg/s in all
                    producer.send_batch(_batch(250, 1000, seed=seq), partition=p)
                    seq += 1
                time.sleep(0.05)

    stayers = [_worker_process(url, "joins", "key_shared", f"stay-{i}", drain=False)
               for i in range(3)]
    for w in stayers:
        w.tell("go")
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    time.sleep(3)  # settled
    first_ms, pauses, quiet = [], [], []
    windows = []
    try:
        for j in range(joins):
            joiner = _worker_process(url, "joins", "key_shared", f"join-{j}", drain=False)
            time.sleep(2)  # the 'before' window
            t0 = time.monotonic()
            joiner.tell("go")
            time.sleep(2)
            joiner.tell("stop")
            r = joiner.result()
            if r["first"] is None:
                raise RuntimeError(f"consumer join-{j} got nothing in 2 s")
            first_ms.append((r["first"] - r["go"]) * 1000)
            windows.append(t0)
            time.sleep(1)  # its leave settles before the next 'before' window
    finally:
        stop.set()
        writer.join()
        for w in stayers:
            w.tell("stop")
        times = [w.result()["times"] for w in stayers]
    for t0 in windows:
        for ts in times:
            pauses.append(_longest_gap(ts, t0, t0 + 2) * 1000)
            quiet.append(_longest_gap(ts, t0 - 2, t0) * 1000)
    return first_ms, pauses, quiet


def _longest_gap(times: list[float], lo: float, hi: float) -> float:
    inside = [lo, *(t for t in times if lo < t < hi), hi]
    return max(b - a for a, b in itertools.pairwise(inside))


def subscriptions(quick: bool = True) -> Path:
    messages, runs, joins = sized((400_000, 3, 5) if quick else (2_000_000, 5, 15),
                                  (4_000, 1, 1))
    with broker_with_topic(TOPIC, PARTITIONS) as broker:
        url = broker.url
        with Producer(TOPIC, broker=url, max_in_flight=16) as producer:
            for p in range(PARTITIONS):  # each partition's batches pipelined, one wait
                producer.send_batch(pa.Table.from_batches(
                    [_batch(1000, 1000, seed=i * PARTITIONS + p)
                     for i in range(messages // 1000 // PARTITIONS)]), partition=p)
        rates: dict[str, list[float]] = {"exclusive": [], "shared": [], "key_shared": []}
        acks: list[float] = []
        with Admin(url) as admin:
            writes0 = admin.stats().get("cursor_writes", 0)
        ack_calls = 0.0
        busiest: list[float] = []  # key_shared: keys are not split evenly
        cpu: dict[str, list[ProcessCpu]] = {mode: [] for mode in rates}
        unit = loop_unit_us()
        for run in range(runs):  # interleaved, so drift hits each alike
            for mode, n in (("exclusive", 1), ("shared", 4), ("key_shared", 4)):
                cpu[mode].append(ProcessCpu(broker.proc.pid))
                rate, ack_rate, most = _throughput(url, mode, n, messages, run, cpu[mode][-1])
                rates[mode].append(rate)
                if mode == "key_shared":
                    busiest.append(most)
                if mode == "shared":
                    acks.append(ack_rate)
                ack_calls += ack_rate * messages / rate
        with Admin(url) as admin:
            writes = admin.stats().get("cursor_writes", 0) - writes0
        first_ms, pauses, quiet = _joins(url, joins)
    figures = [
        Figure("4 shared consumers", "msg/s", rates["shared"], "1 exclusive",
               rates["exclusive"], aim="ratio >= 0.8",
               aim_check=lambda v, r: r is not None and r >= 0.8),
        Figure("4 key_shared consumers", "msg/s", rates["key_shared"], "1 exclusive",
               rates["exclusive"], aim="ratio >= 0.9",
               aim_check=lambda v, r: r is not None and r >= 0.9),
        Figure("ack calls, 4 shared consumers", "acks/s", acks),
        Figure("join: until the new consumer's first message", "ms", first_ms,
               higher_is_better=False),
        Figure("join: longest pause of the others, p99", "ms",
               [_p99(pauses)], "no join", [_p99(quiet)], aim="<= 100 ms",
               higher_is_better=False, aim_check=lambda v, r: v <= 100),
        *cost_figures("4 shared consumers", messages, cpu["shared"], unit,
                      baseline=("1 exclusive", cpu["exclusive"])),
        *cost_figures("4 key_shared consumers", messages, cpu["key_shared"], unit,
                      baseline=("1 exclusive", cpu["exclusive"])),
    ]
    console.print(f"{messages:,} messages of 100 B over {PARTITIONS} partitions, 1,000 keys; "
                  f"{ack_calls / max(writes, 1):.1f} ack calls per cursor write "
                  f"({writes:,} writes); the busiest key_shared consumer got "
                  f"{min(busiest):.2f}-{max(busiest):.2f}x an even share; "
                  f"{joins} joins into 3 key_shared consumers at "
                  "20,000 msg/s; each consumer a process, receive queue 1,000")
    return report("subscriptions", figures,
                  {"messages": messages, "runs": runs, "joins": joins,
                   "partitions": PARTITIONS},
                  {"ack_calls_per_cursor_write": ack_calls / max(writes, 1),
                   "key_shared_busiest_share": busiest,
                   "pauses_ms": pauses, "quiet_pauses_ms": quiet})


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _worker(url: str, subscription: str, mode: str, name: str, drain: bool) -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    stopped = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.readline()
        stopped.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    go, cpu = time.monotonic(), cpu_seconds()
    n = acks = 0
    times: list[float] = []
    last = None  # when the last ack returned
    with Consumer(TOPIC, subscription, mode=mode, consumer_name=name, broker=url,
                  initial=Offset.earliest()) as consumer:
        while not stopped.is_set():
            batch = consumer.receive(timeout=1.0 if drain else 0.05)
            if batch is None:
                if drain and (n or time.monotonic() - go > 30):
                    break  # drained (or never given anything)
                continue
            times.append(time.monotonic())
            consumer.ack(batch)
            last = time.monotonic()
            n += batch.num_rows
            acks += 1
    print(json.dumps({"messages": n, "acks": acks, "go": go, "cpu": cpu_seconds() - cpu,
                      "first": times[0] if times else None, "last": last,
                      "times": [] if drain else times}), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6] == "1")
