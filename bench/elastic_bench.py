"""Reading across a scale event: a window that spans an event, beside the same messages in a
topic that had its final partition count from the start (``python -m bench elastic``)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.harness import Figure, repeat, report, sized, timed
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.enumerator import Enumerator, Query
from tierstream.model.message_format import as_produce_batch, key_hashes
from tierstream.model.positions import Position
from tierstream.runtime.local import run_splits
from tierstream.splits.split import StreamCut, chains

GROWN, FLAT = "bench/elastic/grown", "bench/elastic/flat"


def _write(store: Store, topic: str, first: int, count: int, per_entry: int, t0: int) -> None:
    """Messages ``first .. first+count`` (keys among 1,000 users) routed by the topic's count
    in force, ``per_entry`` to an entry, in order per partition."""
    partitions = store.topic(topic).partitions
    ns = np.arange(first, first + count)
    keys = pa.array([f"user-{n * 7919 % 1000}" for n in ns.tolist()])
    route = key_hashes(keys).to_numpy() % partitions
    value = b"x" * 120
    for p in range(partitions):
        rows = np.flatnonzero(route == p)
        for i in range(0, len(rows), per_entry):
            take = pa.array(rows[i:i + per_entry])
            store.partition(topic, p).append(as_produce_batch(pa.record_batch({
                "key": keys.take(take), "value": [value] * len(take),
                "publish_time": pa.array(t0 + ns[rows[i:i + per_entry]] * 10)})),
                producer=None, sequence_id=None)


def elastic(quick: bool = True) -> Path:
    """Read throughput (local runner) of a window spanning a 2 -> 8 scale event, beside the
    same messages in a topic created with 8 partitions, for keyRanges 1 and 4."""
    messages, per_entry = sized((400_000, 500) if quick else (1_600_000, 1000), (4_000, 100))
    t0 = 1_793_491_200_000
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(StoreConfig.from_options({"dataDir": str(Path(tmp) / "data"),
                                                "fsync": False}))
        try:
            store.create_topic(GROWN, 2)
            store.create_topic(FLAT, 8)
            half = messages // 2
            _write(store, GROWN, 0, half, per_entry, t0)
            _write(store, FLAT, 0, half, per_entry, t0)
            store.set_partitions(GROWN, 8)
            _write(store, GROWN, half, messages - half, per_entry, t0)
            _write(store, FLAT, half, messages - half, per_entry, t0)
            ends = {}
            for t in (GROWN, FLAT):
                store.seal(t)
                last = {s.partition: s for s in store.segments(t) if s.entries}
                ends[t] = StreamCut.of(t, {p: Position(p, s.segment_id, s.entries, 0)
                                           for p, s in last.items()})
            data_dir = store.config.data_dir
        finally:
            store.close()
        enum = Enumerator(data_dir=data_dir)
        figures = []
        found: dict[str, int] = {}
        for k in (1, 4):
            plans = {t: list(enum.plan(Query(topics=(t,), end=ends[t], key_ranges=k)))
                     for t in (GROWN, FLAT)}
            found.update({f"{t} k={k} chains": len(chains(plans[t])) for t in plans})

            def rate(splits: list, n: int = messages) -> float:
                return n / timed(lambda: sum(b.num_rows for b in run_splits(splits)))

            grown = repeat(lambda p=plans[GROWN]: rate(p), 5)
            flat = repeat(lambda p=plans[FLAT]: rate(p), 5)
            figures.append(Figure(f"read across a 2 -> 8 scale event, keyRanges={k}", "msg/s",
                                  grown, "never scaled (8 partitions)", flat, aim=">= 0.9",
                                  aim_check=lambda v, r: r is not None and r >= 0.9))
        enum.close()
    return report("elastic", figures, {"messages": messages, "per_entry": per_entry},
                  {"chains": found, "when": time.time()})
