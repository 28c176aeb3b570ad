"""``fold_latest``, the one rule of a compacted view, against a fold written the plain way:
rows in and out of position order, over several partitions and many chunks."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pyarrow as pa
import pytest

from tierstream.model.compacted_view import fold_latest
from tierstream.model.message_format import MESSAGE_SCHEMA, key_hash


def _rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    seen = set()
    while len(out) < n:
        pos = (rng.randrange(3), rng.randrange(1, 5), rng.randrange(20), rng.randrange(5))
        if pos in seen:
            continue
        seen.add(pos)
        roll = rng.random()
        key = None if roll < 0.1 else f"k{rng.randrange(25)}"
        out.append({"partition": pos[0], "segment_id": pos[1], "entry_id": pos[2],
                    "batch_index": pos[3], "key": key, "key_hash": key_hash(key),
                    "value": b"" if roll > 0.85 else f"v{len(out)}".encode(),
                    "publish_time": 1, "event_time": None, "properties": []})
    return out


def _plain(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    view: dict[tuple[int, str], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: (r["partition"], r["segment_id"], r["entry_id"],
                                         r["batch_index"])):
        if r["key"] is not None:
            view[(r["partition"], r["key"])] = r
    live = [r for r in view.values() if r["value"]]
    return sorted((r["partition"], r["segment_id"], r["entry_id"], r["batch_index"], r["key"],
                   r["value"]) for r in live)


@pytest.mark.parametrize("ordered", [True, False])
def test_the_fold_is_the_latest_live_version_per_partition_and_key(ordered: bool) -> None:
    rng = random.Random(7 + ordered)
    for _ in range(20):
        rows = _rows(rng, rng.randrange(1, 300))
        if ordered:
            rows.sort(key=lambda r: (r["partition"], r["segment_id"], r["entry_id"],
                                     r["batch_index"]))
        else:
            rng.shuffle(rows)
        cut = sorted(rng.sample(range(len(rows) + 1), min(len(rows) + 1, 6)))
        table = pa.Table.from_batches([
            pa.RecordBatch.from_pylist(rows[a:z], schema=MESSAGE_SCHEMA)
            for a, z in itertools.pairwise(cut)], schema=MESSAGE_SCHEMA)
        got = fold_latest(table).to_pylist()
        if ordered:  # as the compactor calls it, trusting the order
            assert fold_latest(table, in_order=True).to_pylist() == got
        positions = [(r["partition"], r["segment_id"], r["entry_id"], r["batch_index"])
                     for r in got]
        assert positions == sorted(positions)  # in partition and position order
        assert sorted((r["partition"], r["segment_id"], r["entry_id"], r["batch_index"],
                       r["key"], r["value"]) for r in got) == _plain(
            [r for a, z in itertools.pairwise(cut) for r in rows[a:z]])
