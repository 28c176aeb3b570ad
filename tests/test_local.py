"""Splits, the enumerator and the readers: hand-off, moves, data loss, bad queries."""

from __future__ import annotations

import logging
import pickle
import threading
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

import tierstream as ts
from tierstream.client import Producer
from tierstream.errors import ConfigError, DataLossError, NotFoundError, UnavailableError
from tierstream.model.positions import KeyRange, Offset, Position
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind, Replica, Split, StreamCut

from .logs import BASE, TOPIC, fill, running_log
from .timing import scaled


def _fill(log, partitions: int = 2, batches: int = 13) -> None:  # type: ignore[no-untyped-def]
    fill(log, partitions=partitions, batches=batches)


def _values(table: pa.Table) -> list[str]:
    return sorted(v.decode() for v in table.column("value").to_pylist())


def test_split_round_trips_through_json_and_pickle() -> None:
    split = Split(topic=TOPIC, partition=1, segment_id=7, start=Position(1, 7, 3, 2),
                  end=Position(1, 7, 90, 0), reader=ReaderKind.BOOKIE,
                  key_range=KeyRange(100, 2000), start_time=5, end_time=None,
                  replicas=(Replica("bookie-0", "grpc://10.0.0.5:7000", "/a"),
                            Replica("bookie-1", None, "/b")),
                  broker="grpc://127.0.0.1:1", estimated_bytes=9)
    assert Split.from_json(split.to_json()) == split
    assert pickle.loads(pickle.dumps(split)) == split
    assert split.split_id == f"{TOPIC}/1/7/1:7:3:2-1:7:90:0/100:2000"
    cut = StreamCut.of(TOPIC, {0: Position(0, 1, 2, 3), 1: Position(1, 4, 5, 6)})
    assert StreamCut.from_json(cut.to_json()) == cut


@pytest.mark.parametrize("text", ['{"v": 99, "topic": "a/b/c"}', "[1, 2]", "not json",
                                  '{"v": 1, "topic": "a/b/c", "positions": {"0": {"x": 1}}}'])
def test_malformed_cuts_and_splits_are_clear_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="stream cut"):
        StreamCut.from_json(text)
    with pytest.raises(ConfigError, match="split"):
        Split.from_json(text)


def test_a_split_of_the_old_format_is_refused_with_what_to_do() -> None:
    old = {"v": 1, "topic": TOPIC, "partition": 0, "segment_id": 1,
           "start": Position(0, 1, 0, 0).to_dict(), "end": None, "reader": "bookie-log",
           "key_range": [0, 65536], "bookie_dirs": ["/data/bookies/bookie-0"]}
    with pytest.raises(ConfigError, match=r"format version 1; this tierstream reads version 3 "
                                          r"\(.*plan the read again\)"):
        Split.from_dict(old)


def test_batch_read_then_tail_from_its_end_cut_is_exactly_the_log(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        log.store.create_topic(TOPIC, 3)
        stop = threading.Event()
        sent: list[str] = []

        def produce() -> None:
            with Producer(TOPIC, broker=log.url, batch_size=20) as producer:
                i = 0
                while not stop.is_set() and i < 4000:
                    batch = [f"m{i + j}" for j in range(20)]
                    producer.send_many({"value": v.encode(), "key": f"k{int(v[1:]) % 7}"}
                                       for v in batch)
                    sent.extend(batch)
                    i += 20

        writer = threading.Thread(target=produce)
        writer.start()
        while len(sent) < 400:
            threading.Event().wait(0.01)
        cut = ts.latest_cut(TOPIC, **log.kw())
        before = ts.read(TOPIC, end=cut, **log.kw())
        seen = Counter(_values(before))
        stream = ts.tail(TOPIC, start=cut, key_ranges=2, **log.kw())
        stop.set()
        writer.join()
        total = len(sent)
        while sum(seen.values()) < total:
            batch = next(stream)
            seen.update(v.decode() for v in batch.column("value").to_pylist())
        stream.close()
        assert sum(seen.values()) == total
        assert set(seen) == set(sent) and max(seen.values()) == 1, "gap or duplicate at the cut"


def test_tail_from_latest_follows_from_the_call_not_from_the_first_next(tmp_path: Path
                                                                          ) -> None:
    # Regression: "latest" was resolved when the iterator was first advanced, so a message
    # produced between tail() and the first next() was skipped.
    with running_log(tmp_path / "data") as log:
        _fill(log, partitions=1, batches=1)
        with ts.tail(TOPIC, start="latest", **log.kw()) as stream:
            with Producer(TOPIC, broker=log.url) as producer:
                producer.send("after the call")
            got: list[str] = []
            reader = threading.Thread(target=lambda: got.extend(
                v.decode() for v in next(stream).column("value").to_pylist()), daemon=True)
            reader.start()
            reader.join(timeout=scaled(30))
        assert got == ["after the call"]


def test_tail_says_at_the_call_that_the_broker_is_unreachable() -> None:
    with pytest.raises(UnavailableError, match="cannot reach the broker"):
        ts.tail(TOPIC, broker="grpc://127.0.0.1:1")


def test_tail_from_a_time_reads_history_then_follows(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=2) as log:
        _fill(log, partitions=1, batches=6)
        log.store.offloader.offload_topic(TOPIC)
        stream = ts.tail(TOPIC, start=Offset.at_time(BASE + 100_000), **log.kw())
        got = []
        while len(got) < 200:
            got.extend(v.decode() for v in next(stream).column("value").to_pylist())
        with Producer(TOPIC, broker=log.url) as producer:
            producer.send("live")
        while "live" not in got:
            got.extend(v.decode() for v in next(stream).column("value").to_pylist())
        stream.close()
        # history comes from several splits in parallel (and tier files in key-bucket order):
        # each message once, each key in order; then the live message
        history = got[:200]
        assert sorted(history) == sorted(f"0-{i}" for i in range(100, 300))
        for key in range(13):
            mine = [int(v.split("-")[1]) for v in history if int(v.split("-")[1]) % 13 == key]
            assert mine == sorted(mine)
        assert got[200:] == ["live"]


def test_a_segment_that_moves_after_planning_is_read_from_where_it_is(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        _fill(log)
        want = _values(log.everything())
        splits = ts.plan(TOPIC, key_ranges=2, **log.kw())
        kinds = Counter(s.reader for s in splits)
        assert kinds[ReaderKind.BOOKIE] and kinds[ReaderKind.TAIL]
        # every closed segment moves to the tier and loses its bookie copy; the open ones
        # are sealed; all after planning
        log.store.seal(TOPIC)
        off = log.store.offloader
        for plog in log.store.partitions(TOPIC):
            for seg in plog.closed_segments():
                off.delete_bookie_copy(plog, off.offload_segment(plog, seg))
        got = [v.decode() for s in splits for b in open_reader(s)
               for v in b.column("value").to_pylist()]
        assert sorted(got) == want


def test_reader_choice_follows_the_data_and_can_be_forced(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        _fill(log, partitions=1)
        plog = log.store.partition(TOPIC, 0)
        first = plog.closed_segments()[0]
        log.store.offloader.offload_segment(plog, first)
        splits = ts.plan(TOPIC, **log.kw())
        by_seg = {s.segment_id: s.reader for s in splits}
        assert by_seg[first.segment_id] is ReaderKind.TIER
        assert ReaderKind.BOOKIE in by_seg.values() and ReaderKind.TAIL in by_seg.values()
        want = _values(log.everything())
        # the broker serves every location: forcing tail-consumer always works
        forced = ts.plan(TOPIC, reader="tail-consumer", **log.kw())
        assert {sp.reader for sp in forced} == {ReaderKind.TAIL}
        assert _values(ts.read(TOPIC, reader="tail-consumer", **log.kw())) == want
        # parquet-tier only where a tier file exists
        with pytest.raises(ConfigError, match=r"cannot read segment .* lives in bookies"):
            ts.plan(TOPIC, reader="parquet-tier", **log.kw())
        # bookie-log while bookie copies exist (the tiered one still has its copy), not after
        with pytest.raises(ConfigError, match=r"cannot read segment .* lives in open"):
            ts.plan(TOPIC, reader="bookie-log", **log.kw())  # the open segment
        log.store.offloader.delete_bookie_copy(plog, plog.closed_segments()[0])
        closed_only = StreamCut.of(TOPIC, {0: Position(0, first.segment_id + 1, 0, 0)})
        with pytest.raises(ConfigError, match=f"cannot read segment {first.segment_id}"):
            ts.plan(TOPIC, end=closed_only, reader="bookie-log", **log.kw())


def test_large_segments_split_by_entries_and_partitions_by_key_ranges(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=100) as log:
        _fill(log, partitions=1, batches=40)
        log.store.seal(TOPIC)
        seg = log.store.partition(TOPIC, 0).closed_segments()[0]
        splits = ts.plan(TOPIC, max_split_bytes=seg.bytes // 4, key_ranges=8, **log.kw())
        assert len(splits) == 4 * 8
        assert {s.key_range for s in splits} == set(KeyRange.split(8))
        assert _values(ts.read(TOPIC, max_split_bytes=seg.bytes // 4, key_ranges=8,
                               **log.kw())) == _values(log.everything())


def test_data_loss_fails_by_default_and_is_skipped_on_request(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        _fill(log, partitions=1)
        log.store.set_retention(TOPIC, 1)
        first = log.store.partition(TOPIC, 0).closed_segments()[0]
        removed = log.store.offloader.apply_retention(
            TOPIC, now=(first.max_publish_time or 0) + 2)
        assert [r["segment_id"] for r in removed] == [first.segment_id]
        with pytest.raises(DataLossError) as info:
            ts.plan(TOPIC, start=Offset.at_time(BASE), **log.kw())
        text = str(info.value)
        assert TOPIC in text and "partition 0" in text and f"{first.segment_id}" in text
        with caplog.at_level(logging.WARNING):
            table = ts.read(TOPIC, start=Offset.at_time(BASE), fail_on_data_loss=False,
                            **log.kw())
        assert "data loss" in caplog.text
        assert len(table) == len(log.everything())
        # earliest means "what survives": not a loss
        assert len(ts.read(TOPIC, **log.kw())) == len(table)
        cut = StreamCut.of(TOPIC, {0: Position(0, first.segment_id, 1, 0)})
        with pytest.raises(DataLossError):
            ts.plan(TOPIC, start=cut, **log.kw())


def test_bad_queries_are_clear_errors(tmp_path: Path) -> None:
    with running_log(tmp_path / "data") as log:
        _fill(log, partitions=2, batches=1)
        kw = log.kw()
        with pytest.raises(ConfigError, match="before it starts"):
            ts.plan(TOPIC, start="2026-11-02", end="2026-11-01", **kw)
        with pytest.raises(NotFoundError, match="'acme/web/nope'"):
            ts.plan("acme/web/nope", **kw)
        for k in (0, 65537):
            with pytest.raises(ConfigError, match=f"invalid number of key ranges {k}"):
                ts.plan(TOPIC, key_ranges=k, **kw)
        with pytest.raises(ConfigError, match="stream cut"):
            ts.plan(TOPIC, start=StreamCut.from_json('{"v": 1, "topic": "x"}'), **kw)
        with pytest.raises(ConfigError, match="no position for partition 1"):
            ts.plan(TOPIC, start=StreamCut.of(TOPIC, {0: Position(0, 1, 0, 0)}), **kw)
        with pytest.raises(ConfigError, match="invalid reader 'fast'"):
            ts.plan(TOPIC, reader="fast", **kw)
        with pytest.raises(ConfigError, match="invalid partition"):
            ts.plan(TOPIC, partitions=[5], **kw)
        with pytest.raises(ConfigError, match="tail"):
            ts.plan(TOPIC, end=None, **kw)


def test_a_time_end_in_the_future_still_finishes(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        _fill(log, partitions=2)
        future = Offset.at_time(BASE + 10**12)
        splits = ts.plan(TOPIC, end=future, **log.kw())
        assert all(s.end is not None for s in splits), "a bounded plan has an unbounded split"
        assert len(ts.read(TOPIC, end=future, **log.kw())) == len(log.everything())
