"""Splits: immutable, picklable units of work that carry everything their reader needs.

A split covers one partition between two positions ``[start, end)`` (``end=None``: the open
tail, unbounded), restricted to ``[start_time, end_time)`` of publish time and to one key range.
The enumerator makes the splits of a plan disjoint, so every message is read by exactly one.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from tierstream.errors import ConfigError
from tierstream.model.positions import EntryRanges, KeyRange, Offset, OffsetKind, Position
from tierstream.util.timeutil import format_ms, now_ms

__all__ = [
    "CUT_FORMAT_VERSION",
    "SPLIT_FORMAT_VERSION",
    "BoundLike",
    "Cuts",
    "ReaderKind",
    "Replica",
    "Split",
    "StreamCut",
    "TierLocation",
    "as_bound",
    "chains",
    "check_window",
    "cuts_from_dict",
    "cuts_to_dict",
    "splits_from_json",
    "splits_to_json",
]

#: Version 2: a bookie-log split names its replicas by bookie id and network endpoint (a
#: reader on any host can use them), with the directory on the store's host only as a hint.
#: Version 3: a split of a sealed segment lists the entries it skips (``skipped``): a reader
#: that did not know them would show aborted transactions' rows, so older ones refuse it.
SPLIT_FORMAT_VERSION = 3
#: Stream cuts (in checkpoints and files users keep) have their own version: still 1.
CUT_FORMAT_VERSION = 1


class ReaderKind(enum.Enum):
    """Which reader serves a split: where its data lives."""

    TAIL = "tail-consumer"  # the open segment, through the broker
    BOOKIE = "bookie-log"  # a closed segment, straight from the ledger files
    TIER = "parquet-tier"  # an offloaded segment, from its Parquet file

    @classmethod
    def parse(cls, text: str) -> ReaderKind:
        for kind in cls:
            if text in (kind.value, kind.name.lower()):
                return kind
        raise ConfigError(f"invalid reader {text!r}: expected one of "
                          f"{', '.join(k.value for k in cls)}")


@dataclass(frozen=True, kw_only=True)
class TierLocation:
    """What a tier reader needs besides the file URL."""

    s3_endpoint: str | None = None
    s3_region: str | None = None


@dataclass(frozen=True)
class Replica:
    """One bookie holding a copy of a segment: its id, the endpoint that serves its ledgers
    over the network (None: it has not advertised one), and its directory on the store's
    host (a hint: read directly when this host sees it)."""

    bookie: str
    endpoint: str | None = None
    local_dir: str | None = None

    def to_list(self) -> list[str | None]:
        return [self.bookie, self.endpoint, self.local_dir]


@dataclass(frozen=True, kw_only=True)
class Split:
    """One unit of work. Compare, hash and pickle freely; ``split_id`` is stable."""

    topic: str
    partition: int
    segment_id: int
    start: Position
    end: Position | None
    reader: ReaderKind
    key_range: KeyRange = field(default_factory=KeyRange.full)
    start_time: int | None = None
    end_time: int | None = None
    replicas: tuple[Replica, ...] = ()
    tier_url: str | None = None
    #: the tier file's size when known: it is opened without a HEAD request
    tier_bytes: int | None = None
    tier: TierLocation = field(default_factory=TierLocation)
    broker: str | None = None
    estimated_bytes: int = 0
    #: The partition whose chain this split joins, None: its own. A partition grown at a
    #: scale event joins the chain of the partition its keys came from when the read holds
    #: that partition's data from before the event (``lineage.py``): read in one chain, in
    #: partition order, every key's messages come out in log order across the event.
    chain: int | None = None
    #: entries inside the split every reader skips (a sealed segment's aborted or set-aside
    #: transaction entries: SegmentRecord.skipped)
    skipped: EntryRanges = ()

    @property
    def root(self) -> int:
        """The partition whose chain this split is read in (see ``chain``)."""
        return self.partition if self.chain is None else self.chain

    def whole(self) -> Split:
        """This split with every key (and no size estimate): what the key-range splits of
        one chunk have in common."""
        return replace(self, key_range=KeyRange.full(), estimated_bytes=0)

    def __post_init__(self) -> None:
        if self.start.partition != self.partition or (
                self.end is not None and self.end.partition != self.partition):
            raise ConfigError(f"split positions {self.start} .. {self.end} are not in "
                              f"partition {self.partition}")
        if self.end is not None and self.end < self.start:
            raise ConfigError(f"split end {self.end} is before its start {self.start}")

    @property
    def split_id(self) -> str:
        end = "tail" if self.end is None else str(self.end)
        return (f"{self.topic}/{self.partition}/{self.segment_id}/{self.start}-{end}/"
                f"{self.key_range}")

    @property
    def bounded(self) -> bool:
        return self.end is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": SPLIT_FORMAT_VERSION,
            "topic": self.topic, "partition": self.partition, "segment_id": self.segment_id,
            "start": self.start.to_dict(), "end": None if self.end is None else self.end.to_dict(),
            "reader": self.reader.value, "key_range": self.key_range.to_list(),
            "start_time": self.start_time, "end_time": self.end_time,
            "replicas": [r.to_list() for r in self.replicas], "tier_url": self.tier_url,
            "tier_bytes": self.tier_bytes,
            "tier": {"s3_endpoint": self.tier.s3_endpoint, "s3_region": self.tier.s3_region},
            "broker": self.broker, "estimated_bytes": self.estimated_bytes,
            "chain": self.chain, "skipped": [list(r) for r in self.skipped],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Split:
        if not isinstance(data, dict) or data.get("v") != SPLIT_FORMAT_VERSION:
            version = data.get("v") if isinstance(data, dict) else None
            raise ConfigError(f"cannot read split of format version {version!r}; this "
                              f"tierstream reads version {SPLIT_FORMAT_VERSION} (splits "
                              "are not kept across upgrades: plan the read again)")
        try:
            return cls(
                topic=data["topic"], partition=int(data["partition"]),
                segment_id=int(data["segment_id"]), start=Position.from_dict(data["start"]),
                end=None if data["end"] is None else Position.from_dict(data["end"]),
                reader=ReaderKind(data["reader"]), key_range=KeyRange(*data["key_range"]),
                start_time=data.get("start_time"), end_time=data.get("end_time"),
                replicas=tuple(Replica(*r) for r in data.get("replicas") or ()),
                tier_url=data.get("tier_url"), tier_bytes=data.get("tier_bytes"),
                tier=TierLocation(**(data.get("tier") or {})), broker=data.get("broker"),
                estimated_bytes=int(data.get("estimated_bytes") or 0),
                chain=None if data.get("chain") is None else int(data["chain"]),
                skipped=tuple((int(lo), int(hi)) for lo, hi in data.get("skipped") or ()),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed split: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str) -> Split:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError:
            raise ConfigError(f"malformed split JSON: {text[:80]!r}") from None


def splits_to_json(splits: list[Split]) -> str:
    """A list of splits as one JSON document (what :func:`splits_from_json` reads)."""
    return json.dumps([s.to_dict() for s in splits], separators=(",", ":"))


def splits_from_json(text: str, *, what: str = "splits") -> list[Split]:
    """The splits of a JSON list of splits; ConfigError naming ``what`` otherwise."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError(f"invalid {what}: not JSON ({text[:60]!r})") from None
    if not isinstance(data, list):
        raise ConfigError(f"invalid {what}: expected a JSON list of splits")
    return [Split.from_dict(d) for d in data]


def chains(splits: list[Split]) -> list[list[Split]]:
    """The splits grouped by (topic, partition, key range), each group in log order: read a
    group's splits one after another and every key's messages come out in log order (key
    ranges never share a key). A grown partition's splits join the group of the partition
    their keys came from (``Split.chain``), after it: parents have lower numbers. In order of
    first appearance."""
    groups: dict[tuple[str, int, KeyRange], list[Split]] = {}
    for split in splits:
        groups.setdefault((split.topic, split.root, split.key_range), []).append(split)
    return [sorted(g, key=lambda s: (s.partition, s.start)) for g in groups.values()]


@dataclass(frozen=True)
class StreamCut:
    """A position per partition of one topic: the exact boundary between before and after."""

    topic: str
    positions: tuple[tuple[int, Position], ...]

    @classmethod
    def of(cls, topic: str, positions: dict[int, Position]) -> StreamCut:
        for p, pos in positions.items():
            if pos.partition != p:
                raise ConfigError(f"stream cut maps partition {p} to a position in partition "
                                  f"{pos.partition}")
        return cls(topic, tuple(sorted(positions.items())))

    def __getitem__(self, partition: int) -> Position:
        for p, pos in self.positions:
            if p == partition:
                return pos
        raise KeyError(partition)

    def get(self, partition: int) -> Position | None:
        try:
            return self[partition]
        except KeyError:
            return None

    @property
    def partitions(self) -> list[int]:
        return [p for p, _ in self.positions]

    def to_dict(self) -> dict[str, Any]:
        return {"v": CUT_FORMAT_VERSION, "topic": self.topic,
                "positions": {str(p): pos.to_dict() for p, pos in self.positions}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> StreamCut:
        if not isinstance(data, dict) or data.get("v") != CUT_FORMAT_VERSION:
            raise ConfigError(f"malformed stream cut {str(data)[:120]!r}: expected "
                              f'{{"v": {CUT_FORMAT_VERSION}, "topic": ..., "positions": ...}}')
        try:
            positions = {int(p): Position.from_dict(pos)
                         for p, pos in dict(data["positions"]).items()}
            return cls.of(str(data["topic"]), positions)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed stream cut {str(data)[:120]!r}: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> StreamCut:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError:
            raise ConfigError(f"malformed stream cut JSON {text[:80]!r}") from None


#: A stream cut per topic: the position of a read over several topics.
Cuts = dict[str, StreamCut]


def cuts_to_dict(cuts: Cuts, *, single: bool) -> dict[str, Any]:
    """JSON primitives: the topic's own cut when ``single``, else ``{"v": 1, "cuts": {...}}``."""
    if single:
        (cut,) = cuts.values()
        return cut.to_dict()
    return {"v": CUT_FORMAT_VERSION, "cuts": {t: cuts[t].to_dict() for t in sorted(cuts)}}


def cuts_from_dict(data: Any) -> Cuts:
    """Either form of :func:`cuts_to_dict`."""
    if not (isinstance(data, dict) and "cuts" in data):
        cut = StreamCut.from_dict(data)
        return {cut.topic: cut}
    if data.get("v") != CUT_FORMAT_VERSION or not isinstance(data["cuts"], dict):
        raise ConfigError(f"malformed stream cuts {str(data)[:120]!r}: expected "
                          f'{{"v": {CUT_FORMAT_VERSION}, "cuts": {{topic: cut}}}}')
    cuts = {str(t): StreamCut.from_dict(c) for t, c in data["cuts"].items()}
    for t, cut in cuts.items():
        if cut.topic != t:
            raise ConfigError(f"malformed stream cuts: the cut under {t!r} is for {cut.topic!r}")
    return cuts



def check_window(start: Offset | StreamCut | None, end: Offset | StreamCut | None) -> None:
    """ConfigError when a read's ``end`` is before its ``start`` as given (two times, two
    positions in one segment, ``latest`` before a past time): a mix-up that
    would read nothing, refused on every path rather than answered with nothing. Ends that
    need the log to compare (a time and a position) are checked once resolved
    (``enumerator/planner.py``)."""
    if start is None or end is None:
        return
    if isinstance(start, Offset) and isinstance(end, Offset):
        if start.kind is OffsetKind.TIME and end.kind is OffsetKind.TIME:
            assert start.time_ms is not None and end.time_ms is not None
            if end.time_ms < start.time_ms:
                raise ConfigError(f"the read ends at {format_ms(end.time_ms)}, before it "
                                  f"starts at {format_ms(start.time_ms)}: give an end after "
                                  "the start")
        if start.kind is OffsetKind.LATEST and end.kind is OffsetKind.TIME:
            assert end.time_ms is not None
            if end.time_ms < now_ms():
                raise ConfigError(f"the read starts at the latest message and ends at "
                                  f"{format_ms(end.time_ms)}, before it: give an end after "
                                  "now, or a start before the end")
    for p, s, e in _positions_of(start, end):
        # within one segment only: across segments, the end of one and the start of the
        # partition's next name the same point (the planner compares those by its records)
        if e.segment_id == s.segment_id and e < s:
            raise ConfigError(f"the read ends at {e} in partition {p}, before it starts "
                              f"there at {s}: give an end after the start")


def _positions_of(start: Offset | StreamCut, end: Offset | StreamCut
                  ) -> list[tuple[int, Position, Position]]:
    def positions(bound: Offset | StreamCut) -> dict[int, Position]:
        if isinstance(bound, StreamCut):
            return dict(bound.positions)
        if bound.kind is OffsetKind.POSITION and bound.position is not None:
            return {bound.position.partition: bound.position}
        return {}
    ends = positions(end)
    return [(p, s, ends[p]) for p, s in positions(start).items() if p in ends]


#: a bound as the Python API takes it
BoundLike = Offset | StreamCut | str | int | datetime


def as_bound(value: BoundLike | None, what: str) -> Offset | StreamCut | None:
    """A bound given to the Python API: an Offset or StreamCut as it is, text as
    ``earliest``/``latest``, an int (ms) or datetime as a time."""
    if value is None or isinstance(value, Offset | StreamCut):
        return value
    if isinstance(value, str):
        return Offset.parse(value, what=what)
    if isinstance(value, int | datetime):
        return Offset.at_time(value)  # type: ignore[arg-type]
    raise ConfigError(f"invalid {what} {value!r}: expected an Offset, a StreamCut, a time or "
                      "'earliest'/'latest'")
