"""Delayed delivery (``tierstream.deliver_at``): how late held messages reach shared
consumers, and what holding and releasing costs the dispatch.

1. *On time*: messages whose delivery times are spread at random over the next 10 s, read by
   two shared consumers: lateness = receive time - delivery time, p50 / p99 / max.
2. *Cost*: as many messages all due 2 s after they are written (then as many without a
   delivery time), drained by the same consumers: the held ones' rate from their due time,
   beside a second subscription draining all of them once nothing is held (msg/s, same run).

Consumers are tierstream's own ``Consumer`` (the dispatcher is the one Pulsar consumers share),
in threads of this process; the broker is a process of its own, fsync on.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench.harness import Figure, broker_with_topic, console, report, sized
from tierstream.client import Consumer, Producer
from tierstream.model.message_format import DELIVER_AT
from tierstream.model.positions import Offset

TOPIC = "bench/delayed/t"
PARTITIONS = 4
CONSUMERS = 2


def _write(url: str, n: int, due_ms: Any) -> None:
    """``n`` 100-byte messages, message i due at ``due_ms(i)`` (None: no delivery time)."""
    with Producer(TOPIC, broker=url, max_in_flight=16) as producer:
        for start in range(0, n, 1000):
            ids = range(start, min(n, start + 1000))
            props = [[] if due_ms(i) is None else [(DELIVER_AT, str(due_ms(i)))] for i in ids]
            producer.send_batch(pa.record_batch({
                "value": [f"{i:099d}".encode() for i in ids],
                "properties": pa.array(props, pa.map_(pa.string(), pa.string()))}),
                partition=start // 1000 % PARTITIONS)


def _drain(url: str, subscription: str, n: int) -> list[tuple[bytes, float, dict[str, str]]]:
    """Every message, with the wall time (ms) it was received, by CONSUMERS shared
    consumers of a new subscription from the earliest message."""
    got: list[tuple[bytes, float, dict[str, str]]] = []
    lock = threading.Lock()
    done = threading.Event()

    def consume(name: str) -> None:
        with Consumer(TOPIC, subscription, mode="shared", consumer_name=name, broker=url,
                      initial=Offset.earliest()) as consumer:
            while not done.is_set():
                batch = consumer.receive(timeout=0.2)
                if batch is None:
                    continue
                now = time.time() * 1000
                rows = [(v, now, dict(p)) for v, p in zip(
                    batch.column("value").to_pylist(), batch.column("properties").to_pylist(),
                    strict=True)]
                consumer.ack(batch)
                with lock:
                    got.extend(rows)
                    if len(got) >= n:
                        done.set()

    threads = [threading.Thread(target=consume, args=(f"c{i}",)) for i in range(CONSUMERS)]
    for t in threads:
        t.start()
    if not done.wait(120):
        raise RuntimeError(f"{subscription}: {len(got)} of {n} messages in 120 s")
    for t in threads:
        t.join(30)
    return got


def delayed(quick: bool = True) -> Path:
    n = sized(100_000 if quick else 400_000, 2_000)
    spread_s, hold_s = sized((10.0, 2.0), (1.0, 0.5))
    rng = random.Random(7)
    with broker_with_topic(TOPIC, PARTITIONS) as broker:
        url = broker.url
        # 1. on time: due at random over the next spread_s seconds (from the end of writing)
        offsets = [rng.uniform(0, spread_s * 1000) for _ in range(n)]
        base = time.time() * 1000 + 5_000  # writing takes less than this
        _write(url, n, lambda i: int(base + offsets[i]))
        got = _drain(url, "on-time", n)
        late = sorted(at - int(p[DELIVER_AT]) for _, at, p in got)
        early = sum(1 for x in late if x < -5)
        # 2. cost: all due hold_s after writing, beside the same messages undelayed
        with Consumer(TOPIC, "cost-held", mode="shared", broker=url,
                      initial=Offset.latest()), \
                Consumer(TOPIC, "cost-plain", mode="shared", broker=url,
                         initial=Offset.latest()):
            pass  # both subscriptions start after the first part's messages
        due = int(time.time() * 1000 + 3_000 + hold_s * 1000)
        _write(url, n, lambda i: due)
        _write(url, n, lambda i: None)
        t0 = time.time() * 1000
        held = _drain(url, "cost-held", 2 * n)
        held_rate = n / max(1e-3, (max(at for _, at, p in held if DELIVER_AT in p)
                                   - max(due, t0)) / 1000)
        t1 = time.time() * 1000  # every message of it is due now: nothing is held
        plain = _drain(url, "cost-plain", 2 * n)
        plain_rate = 2 * n / max(1e-3, (max(at for _, at, _ in plain) - t1) / 1000)
    p99 = late[int(0.99 * (len(late) - 1))]
    figures = [
        Figure(f"lateness p50 ({n:,} messages due over {spread_s:g} s)", "ms",
               [statistics.median(late)]),
        Figure("lateness p99 (held messages are released on the dispatcher's 50 ms tick)",
               "ms", [p99], higher_is_better=False),
        Figure("lateness max", "ms", [late[-1]], higher_is_better=False),
        Figure("delivered before their time", "messages", [float(early)], aim="0",
               aim_check=lambda v, r: v == 0, higher_is_better=False),
        Figure(f"{n:,} held messages drained from their due time", "msg/s", [held_rate],
               "the same messages once none is held", [plain_rate], aim="ratio >= 0.8",
               aim_check=lambda v, r: r is not None and r >= 0.8),
    ]
    console.print(f"{CONSUMERS} shared consumers (tierstream Consumer, threads), "
                  f"{PARTITIONS} partitions, 100-byte values, fsync on")
    return report("delayed", figures, {"messages": n, "spread_s": spread_s,
                                       "hold_s": hold_s, "consumers": CONSUMERS,
                                       "partitions": PARTITIONS})
