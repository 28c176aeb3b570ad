"""Benchmarks of the source framework (issue 4): planning, readers, key ranges."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import crc32c
import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import (
    Figure,
    console,
    cpu_of,
    fill_clicks,
    loop_unit_us,
    own_cost_figures,
    repeat,
    report,
    save_chart,
    sized,
    timed,
)
from tierstream.bookie.ledger import FRAME_HEADER, read_index
from tierstream.bookie.storage import ledger_paths
from tierstream.broker.config import StoreConfig
from tierstream.broker.store import Store
from tierstream.enumerator import Enumerator, Query
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.model.positions import Offset, Position
from tierstream.readers import open_reader
from tierstream.readers.parquet_tier import selected_row_groups
from tierstream.runtime.local import run_splits
from tierstream.splits.split import ReaderKind, Replica, Split, StreamCut

T0 = 1_700_000_000_000
WEEK = 7 * 86_400_000
TOPIC = "bench/plan/t"


def _synthetic_metadata(path: Path, partitions: int, segments: int) -> None:
    """Segment records of one topic: ``segments`` per partition spread over a week."""
    meta = MetadataStore(path)
    meta.create_topic(TopicName.parse(TOPIC), partitions, created_at=0)
    span = WEEK // segments
    rows = [(TOPIC, p, "CLOSED", 100, 100_000, 1 << 24, T0 + s * span, T0 + (s + 1) * span - 1,
             0, 0, '["bookie-0"]') for p in range(partitions) for s in range(segments)]
    with meta.atomic() as c:
        c.executemany(
            "INSERT INTO segments (topic, partition, state, entries, messages, bytes, "
            "min_publish_time, max_publish_time, created_at, sealed_at, ensemble) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
    meta.close()


def _linear_plan(meta: MetadataStore, partitions: int, t0: int, t1: int) -> int:
    """The baseline planner: every segment record of every partition, filtered."""
    n = 0
    for p in range(partitions):
        for s in meta.segments(TOPIC, p):
            if (s.max_publish_time or 0) >= t0 and (s.min_publish_time or 0) < t1:
                n += 1
    return n


def plan(quick: bool = True) -> Path:
    """Plan a one-hour window over 1,000 partitions x 1,000 segments: binary search vs scan;
    then planning time vs S (segments per partition) for 10 partitions."""
    partitions, segments = sized((1000, 1000), (20, 50))
    t0 = T0 + 3 * 86_400_000
    t1 = t0 + 3_600_000
    query = Query(topics=(TOPIC,), start=Offset.at_time(t0), end=Offset.at_time(t1))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "big"
        data.mkdir()
        console.print(f"writing {partitions * segments:,} synthetic segment records ...")
        _synthetic_metadata(data / "metadata.db", partitions, segments)
        enum = Enumerator(data_dir=data)
        splits = enum.plan(query)
        ours = repeat(lambda: timed(lambda: enum.plan(query)) * 1000, 5 if quick else 9)
        made = repeat(lambda: timed(lambda: list(enum.plan(query))) * 1000, 3 if quick else 5)
        meta = MetadataStore(data / "metadata.db", read_only=True)
        linear = repeat(lambda: timed(lambda: _linear_plan(meta, partitions, t0, t1)) * 1000,
                        3, warmup=0)
        assert _linear_plan(meta, partitions, t0, t1) == len(splits)
        growth: dict[int, tuple[float, float]] = {}
        for s in sized([100, 1000, 10_000] if quick else [100, 1000, 10_000, 100_000], [100]):
            d = Path(tmp) / f"s{s}"
            d.mkdir()
            _synthetic_metadata(d / "metadata.db", 10, s)
            e = Enumerator(data_dir=d)
            w1 = t0 + 7 * (WEEK // s)  # seven segments wide: the same output for every S
            q = Query(topics=(TOPIC,), start=Offset.at_time(t0), end=Offset.at_time(w1))
            m = MetadataStore(d / "metadata.db", read_only=True)
            growth[s] = (min(repeat(lambda e=e, q=q: timed(lambda: e.plan(q)) * 1000, 5)),
                         min(repeat(lambda m=m, w=w1: timed(lambda: _linear_plan(m, 10, t0, w))
                                    * 1000, 2)))
    figures = [Figure("plan 1h window, 1,000 partitions x 1,000 segments", "ms", ours,
                      "linear scan of all records", linear, aim=">= 100x faster, < 100 ms",
                      higher_is_better=False,
                      aim_check=lambda v, r: v < 100 and r is not None and r <= 0.01),
               Figure("plan and make every split object", "ms", made,
                      "linear scan of all records", linear, higher_is_better=False)]
    for s, (b, lin) in growth.items():
        figures.append(Figure(f"plan, 10 partitions, S={s:,}", "ms", [b], "linear scan",
                              [lin], higher_is_better=False))

    def draw(ax: Any) -> None:
        xs = list(growth)
        ax.loglog(xs, [growth[s][0] for s in xs], "o-", label="binary search (ours)")
        ax.loglog(xs, [growth[s][1] for s in xs], "s--", label="linear scan")
        ax.set_xlabel("segments per partition (S)")
        ax.set_ylabel("planning time, 10 partitions (ms)")
        ax.set_title("planning a seven-segment window")
        ax.legend()

    save_chart("plan", draw)
    console.print(f"{len(splits):,} splits planned")
    return report("plan", figures, {"partitions": partitions, "segments": segments,
                                    "window_ms": t1 - t0})


def _segment(root: Path, entries: int, per_entry: int) -> tuple[Store, Any]:
    store = Store(StoreConfig.from_options({"dataDir": str(root), "fsync": False,
                                            "maxEntriesPerSegment": entries + 1,
                                            "deletionLag": "1h"}))
    fill_clicks(store, "bench/read/t", partitions=1, entries=entries, per_entry=per_entry,
                t0=T0, value=lambda n, p: f'{{"n":{n},"page":"/p/{n % per_entry % 50}"}}'
                .encode() + b"." * 70)
    plog = store.partition("bench/read/t", 0)
    (seg,) = plog.closed_segments()
    seg = store.offloader.offload_segment(plog, seg)  # tier copy; bookie copy stays
    return store, seg


def readers(quick: bool = True) -> Path:
    """Each reader's throughput beside its ceiling: bookie-log vs reading the same Arrow IPC
    frames with pyarrow directly, parquet-tier vs pyarrow.parquet on the same file."""
    entries, per_entry, runs = sized((200, 1000, 5) if quick else (500, 2000, 7), (10, 100, 1))
    with tempfile.TemporaryDirectory() as tmp:
        store, seg = _segment(Path(tmp) / "data", entries, per_entry)
        try:
            bookie_dir = store.config.bookie_dir("bookie-0").resolve()
            common: dict[str, Any] = dict(topic="bench/read/t", partition=0,
                                          segment_id=seg.segment_id,
                                          start=Position(0, seg.segment_id, 0, 0),
                                          end=Position(0, seg.segment_id, seg.entries, 0))
            bookie_split = Split(reader=ReaderKind.BOOKIE,
                                 replicas=(Replica("bookie-0", None, str(bookie_dir)),),
                                 **common)
            tier_split = Split(reader=ReaderKind.TIER, tier_url=seg.tier_url, **common)
            log_path, idx_path = ledger_paths(bookie_dir, seg.segment_id)
            parquet_path = store.tier.path(seg.tier_url or "")
        finally:
            store.close()

        def count(it: Any) -> int:
            return sum(b.num_rows for b in it)

        from tierstream.model.message_format import MESSAGE_SCHEMA as bookie_schema

        def ipc_ceiling(checked: bool = False) -> int:
            """pyarrow reading the ledger's IPC frames, nothing else; ``checked``: plus
            CRC-32C (crc32c, hardware) over every frame, the least a verifying reader costs."""
            records = read_index(idx_path)
            n = 0
            with open(log_path, "rb") as f:
                fd = f.fileno()
                for r in records:
                    frame = os.pread(fd, r.frame_len, r.frame_offset)
                    if checked:
                        crc32c.crc32c(frame)
                    _, _, _, _, meta_len, payload_len, _ = FRAME_HEADER.unpack_from(frame)
                    off = FRAME_HEADER.size + meta_len + (8 - meta_len % 8) % 8
                    n += pa.ipc.read_record_batch(
                        pa.py_buffer(frame)[off: off + payload_len], bookie_schema).num_rows
            return n

        def parquet_ceiling() -> int:
            return count(pq.read_table(parquet_path).to_batches())

        messages = entries * per_entry
        assert count(open_reader(bookie_split)) == ipc_ceiling() == messages
        assert count(open_reader(tier_split)) == parquet_ceiling() == messages

        cpu: dict[str, list[float]] = {}

        def rate(name: str, fn: Any) -> float:
            seconds, used = cpu_of(fn)
            cpu.setdefault(name, []).append(used)
            return messages / seconds

        b_ours, b_ceil, b_checked, t_ours, t_ceil = [], [], [], [], []
        for _ in range(runs):  # interleaved: drift hits both sides alike
            b_ours.append(rate("bookie", lambda: count(open_reader(bookie_split))))
            b_ceil.append(rate("ipc", ipc_ceiling))
            b_checked.append(rate("ipc checked", lambda: ipc_ceiling(checked=True)))
            t_ours.append(rate("tier", lambda: count(open_reader(tier_split))))
            t_ceil.append(rate("parquet", parquet_ceiling))
        unit = loop_unit_us()
    bookie_mb = seg.bytes / messages / 1e6
    figures = [
        Figure("bookie-log reader rows/s", "rows/s", b_ours, "pyarrow IPC on the same frames",
               b_ceil, aim="ratio >= 0.8", aim_check=lambda v, r: r is not None and r >= 0.8),
        Figure("bookie-log reader rows/s, vs a ceiling that verifies checksums", "rows/s",
               b_ours, "pyarrow IPC + crc32c over each frame", b_checked),
        Figure("bookie-log reader MB/s (ledger bytes)", "MB/s",
               [r * bookie_mb for r in b_ours]),
        Figure("parquet-tier reader rows/s", "rows/s", t_ours, "pyarrow.parquet.read_table",
               t_ceil, aim="ratio >= 0.8", aim_check=lambda v, r: r is not None and r >= 0.8),
        # in process: the reader's whole cost is this process's CPU (decoding threads too)
        *own_cost_figures("bookie-log reader", messages, cpu["bookie"], unit,
                          baseline=("pyarrow IPC + crc32c", cpu["ipc checked"])),
        *own_cost_figures("parquet-tier reader", messages, cpu["tier"], unit,
                          baseline=("pyarrow.parquet.read_table", cpu["parquet"])),
    ]
    return report("readers", figures, {"messages": messages, "entries": entries})


def keyranges(quick: bool = True) -> Path:
    """Read amplification of k key-range splits and read time vs k, over the tier copy and
    over the bookie copy of one segment, side by side."""
    entries, per_entry = sized((200, 1000) if quick else (500, 2000), (10, 100))
    ks = [1, 2, 4, 8]
    with tempfile.TemporaryDirectory() as tmp:
        store, seg = _segment(Path(tmp) / "data", entries, per_entry)
        data_dir = store.config.data_dir
        path = store.tier.path(seg.tier_url or "")
        store.close()
        meta = pq.ParquetFile(path).metadata

        def size(i: int) -> int:
            rg = meta.row_group(i)
            return sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))

        total = sum(size(i) for i in range(meta.num_row_groups))
        enum = Enumerator(data_dir=data_dir)
        end = StreamCut.of("bench/read/t", {0: Position(0, seg.segment_id, seg.entries, 0)})
        amp: dict[int, float] = {}
        seconds: dict[int, float] = {}
        runs_k: dict[int, list[float]] = {}
        for k in ks:
            splits = enum.plan(Query(topics=("bench/read/t",), end=end, key_ranges=k))
            amp[k] = sum(size(i) for s in splits for i in selected_row_groups(meta, s)) / total
            runs_k[k] = repeat(lambda s=splits, k=k: timed(
                lambda: sum(b.num_rows for b in run_splits(s, parallelism=k))), 3)
            seconds[k] = statistics.median(runs_k[k])
        # the same segment from its bookie copy: a split reads its whole entry range from disk
        # whatever its key range (filtering happens after decoding)
        records = read_index(ledger_paths(store.config.bookie_dir("bookie-0"),
                                          seg.segment_id)[1])
        frame_bytes = sum(r.frame_len for r in records)
        b_amp: dict[int, float] = {}
        b_seconds: dict[int, float] = {}
        b_runs: dict[int, list[float]] = {}
        for k in ks:
            splits = enum.plan(Query(topics=("bench/read/t",), end=end, key_ranges=k,
                                     reader=ReaderKind.BOOKIE))
            b_amp[k] = sum(r.frame_len for s in splits for r in records
                           if s.start.entry_id <= r.entry_id
                           and (s.end is None or r.entry_id < s.end.entry_id)) / frame_bytes
            b_runs[k] = repeat(lambda s=splits: timed(
                lambda: sum(b.num_rows for b in run_splits(s, parallelism=len(s)))), 5)
            b_seconds[k] = statistics.median(b_runs[k])
            if k == 4:  # each range alone, one after another: what k Spark tasks do
                alone = repeat(lambda s=splits: timed(
                    lambda: sum(b.num_rows for x in s for b in open_reader(x))), 5)
                one = list(enum.plan(Query(topics=("bench/read/t",), end=end,
                                           reader=ReaderKind.BOOKIE)))
                whole = repeat(lambda one=one: timed(
                    lambda: sum(b.num_rows for x in one for b in open_reader(x))), 5)
    figures = [Figure("k=4 key-range read amplification (bytes fetched / window bytes)", "x",
                      [amp[4]], "k=1", [amp[1]], aim="<= 1.5", higher_is_better=False,
                      aim_check=lambda v, r: v <= 1.5)]
    figures.append(Figure("k=4 bookie-log read amplification (ledger bytes read / segment)",
                          "x", [b_amp[4]], "k=1", [b_amp[1]], higher_is_better=False))
    for k in ks:
        figures.append(Figure(f"read time, k={k} (local runner, {k} thread(s))", "s",
                              runs_k[k], "k=1", runs_k[1], higher_is_better=False))
    figures.append(Figure("bookie-log: all k=4 ranges, local runner (read once, whole)", "s",
                          b_runs[4], "k=1", b_runs[1], higher_is_better=False,
                          aim="ratio <= 2", aim_check=lambda v, r: r is not None and r <= 2))
    figures.append(Figure("bookie-log: the k=4 ranges read each alone (as Spark tasks)", "s",
                          alone, "one whole read", whole, higher_is_better=False))
    for k in ks:
        figures.append(Figure(f"bookie-log read time, k={k}", "s", b_runs[k], "k=1",
                              b_runs[1], higher_is_better=False))

    def draw(ax: Any) -> None:
        ax.plot(ks, [seconds[1] / seconds[k] for k in ks], "o-", label="tier: speed-up")
        ax.plot(ks, [amp[k] for k in ks], "s--", label="tier: read amplification")
        ax.plot(ks, [b_seconds[1] / b_seconds[k] for k in ks], "^-",
                label="bookie: speed-up")
        ax.plot(ks, [b_amp[k] for k in ks], "v--", label="bookie: read amplification")
        ax.set_xlabel("key ranges per partition (k)")
        ax.set_title("one segment, one partition: tier copy vs bookie copy")
        ax.legend()

    save_chart("keyranges", draw)
    return report("keyranges", figures, {"messages": entries * per_entry, "k": ks},
                  {"amplification": amp, "seconds": seconds,
                   "bookie_amplification": b_amp, "bookie_seconds": b_seconds,
                   "when": time.time()})
