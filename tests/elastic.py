"""Randomized logs of elastic topics: named producers write keyed messages while the topic
grows at 1-3 scale events (and segments roll); what every reader must give back."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tierstream.client import Admin, Producer

from .store.helpers import wait_for
from .timing import scaled


@dataclass
class Written:
    """What was sent, per key in send order (values ``key|seq``), and the counts grown to."""

    by_key: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.by_key.values())


def grow_while_writing(url: str, topic: str, seed: int, *, messages: int = 900,
                       producers: int = 3, events: int | None = None,
                       written: Written | None = None, create: bool = True) -> Written:
    """Write ``messages`` keyed messages from ``producers`` concurrent named producers into
    ``topic`` while it grows ``events`` times (random when None: 1-3) by a random factor."""
    rng = random.Random(seed)
    out = written or Written()
    with Admin(url) as admin:
        if create:
            admin.create_topic(topic, rng.choice([1, 2, 3]))
        count = admin.get_topic(topic).partitions
        if not out.counts:
            out.counts.append(count)
        planned = rng.randint(1, 3) if events is None else events
        factors = [rng.choice([2, 3]) if count * 3 <= 12 else 2 for _ in range(planned)]
    sent = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    per = messages // producers
    base = out.total

    def write(i: int, r: random.Random) -> None:
        name = f"{topic.rsplit('/', 1)[-1]}-p{i}"
        keys = [f"{name}-k{j}" for j in range(r.randint(4, 9))]
        try:
            with Producer(topic, broker=url, name=name, batch_size=r.randint(2, 12)) as prod:
                done = 0
                while done < per:
                    chunk = []
                    for _ in range(min(per - done, r.randint(1, 40))):
                        key = r.choice(keys)
                        with lock:
                            value = f"{key}|{base + sent[0]:07d}"
                            out.by_key[key].append(value)
                            sent[0] += 1
                        chunk.append({"key": key, "value": value})
                    prod.send_many(chunk)  # one thread per key: send order is log order
                    done += len(chunk)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i, random.Random(rng.random())))
               for i in range(producers)]
    for t in threads:
        t.start()
    with Admin(url) as admin:
        for n, factor in enumerate(factors, 1):
            mark = messages * n // (len(factors) + 1)
            wait_for(lambda m=mark: sent[0] >= m or errors or not any(
                t.is_alive() for t in threads), timeout=scaled(120), what="writes")
            count *= factor
            admin.set_partitions(topic, count)
            out.counts.append(count)
            if rng.random() < 0.5:
                admin.seal(topic)  # closed segments too, not only open tails
    for t in threads:
        t.join(scaled(180))
    assert not errors, errors
    return out


def order_errors(written: Written, keys: Iterable[str | None], values: Iterable[bytes]
                 ) -> list[str]:
    """What is wrong with rows read in this order: missing, doubled, or out of key order."""
    got: dict[str, list[str]] = defaultdict(list)
    for key, value in zip(keys, values, strict=True):
        got[str(key)].append(value.decode())
    problems = []
    for key, expected in written.by_key.items():
        seen = got.pop(key, [])
        if seen != expected:
            what = "out of order" if sorted(seen) == sorted(expected) else \
                f"{len(seen)} of {len(expected)} rows"
            problems.append(f"{key}: {what}")
    problems.extend(f"{key}: never written" for key in got)
    return problems


def check_tailed(written: Written, rows: list[pa.RecordBatch], following: Any) -> None:
    """Once the tail handed over everything written: each message once, each key in order."""
    try:
        wait_for(lambda: sum(b.num_rows for b in rows) >= written.total,
                 timeout=scaled(120), what="the tail to catch up")
    finally:
        following.close()
    tailed = pa.Table.from_batches(rows)
    assert order_errors(written, tailed.column("key").to_pylist(),
                        tailed.column("value").to_pylist()) == []
