"""What every crash test checks: a log read back against what producers were acknowledged.

Producers send numbered values ``"<name>:<n>"`` keyed ``"<name>-k<n % KEYS>"`` through a named
:class:`~tierstream.client.Producer`, and record every acknowledged send with the acks the
broker returned. :func:`check` then compares a full read of the topic with those records:

- **missing**: an acknowledged value that is not in the log;
- **duplicated**: a value stored more than once;
- **moved**: an acknowledged value stored at another position than its ack said;
- **order**: a key whose numbers do not increase along its partition;
- **time**: a partition whose ``publish_time`` goes backwards.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tierstream.client import Producer
from tierstream.model.message_format import key_hash

KEYS = 4

Position = tuple[int, int, int, int]


def message(name: str, n: int) -> dict[str, Any]:
    return {"value": f"{name}:{n}".encode(), "key": f"{name}-k{n % KEYS}"}


def send_numbered(producer: Producer, start: int, count: int) -> dict[str, Any]:
    """Send values ``start .. start+count-1`` of ``producer.name`` in one ``send_many``; returns
    the record of that acknowledged send (JSON-able)."""
    acks = producer.send_many(message(producer.name, n) for n in range(start, start + count))
    return {"name": producer.name, "start": start, "count": count,
            "partitions": producer.partitions, "batch_size": producer.batch_size,
            "acks": acks}


def acknowledged_positions(sends: Iterable[dict[str, Any]]) -> dict[str, Position]:
    """Each acknowledged value and the position its ack gives it.

    ``send_many`` routes a keyed message to ``key_hash(key) % partitions`` and cuts each
    partition's messages, in order, into batches of ``batch_size``; acks of one partition come
    back in sequence order, one per batch.
    """
    out: dict[str, Position] = {}
    for send in sends:
        per_partition: dict[int, list[str]] = defaultdict(list)
        for n in range(send["start"], send["start"] + send["count"]):
            m = message(send["name"], n)
            per_partition[key_hash(m["key"]) % send["partitions"]].append(m["value"].decode())
        acks_by_partition: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for ack in send["acks"]:
            acks_by_partition[int(ack["partition"])].append(ack)
        for p, values in per_partition.items():
            acks = sorted(acks_by_partition[p], key=lambda a: a["sequence_id"])
            size = send["batch_size"]
            batches = [values[i:i + size] for i in range(0, len(values), size)]
            assert len(batches) == len(acks), f"{len(acks)} acks for {len(batches)} batches"
            for batch, ack in zip(batches, acks, strict=True):
                for i, value in enumerate(batch):
                    out[value] = (p, ack["segment_id"], ack["entry_id"], i)
    return out


@dataclass
class Report:
    acknowledged: int = 0
    stored: int = 0
    missing: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    moved: list[tuple[str, Position, Position]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    time: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.moved or self.order or self.time)

    def summary(self) -> str:
        return (f"acknowledged {self.acknowledged}, stored {self.stored}, missing "
                f"{len(self.missing)}, duplicated {len(self.duplicated)}, moved "
                f"{len(self.moved)}, order violations {len(self.order)}, publish_time "
                f"violations {len(self.time)}")

    def __str__(self) -> str:
        detail = {"missing": self.missing[:5], "duplicated": self.duplicated[:5],
                  "moved": self.moved[:3], "order": self.order[:5], "time": self.time}
        return f"{self.summary()}; first of each: {json.dumps(detail, default=str)}"


def check(table: pa.Table, sends: Iterable[dict[str, Any]]) -> Report:
    """Compare a read of the whole topic (partition by partition, in log order) with the
    acknowledged sends."""
    acked = acknowledged_positions(sends)
    values = [v.decode() for v in table.column("value").to_pylist()]
    cols = [table.column(c).to_pylist()
            for c in ("partition", "segment_id", "entry_id", "batch_index")]
    stored_at: dict[str, Position] = {}
    for v, pos in zip(values, zip(*cols, strict=True), strict=True):
        stored_at.setdefault(v, pos)
    report = Report(acknowledged=len(acked), stored=len(values))
    report.missing = sorted(v for v in acked if v not in stored_at)
    report.duplicated = sorted(v for v, c in Counter(values).items() if c > 1)
    report.moved = [(v, pos, stored_at[v]) for v, pos in acked.items()
                    if v in stored_at and stored_at[v] != pos]
    last_n: dict[str, int] = {}
    last_pt: dict[int, int] = {}
    keys = table.column("key").to_pylist()
    pts = table.column("publish_time").to_pylist()
    for v, key, p, pt in zip(values, keys, cols[0], pts, strict=True):
        n = int(v.rsplit(":", 1)[1])
        if key in last_n and n < last_n[key]:  # n == last: a duplicate, counted above
            report.order.append(f"{key}: {n} after {last_n[key]}")
        last_n[key] = n
        if pt < last_pt.get(p, pt):
            report.time.append(p)
        last_pt[p] = pt
    return report
