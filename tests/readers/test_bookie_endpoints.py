"""The bookie-log reader on a host without the store's files: bookie endpoints, replica
fallback, broker fallback only when the segment left the bookies, and counts of each path."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tierstream.bookie.ledger import read_index
from tierstream.bookie.server import BookieServer
from tierstream.bookie.storage import ledger_paths
from tierstream.enumerator import Enumerator, Query
from tierstream.errors import AuthError, CorruptionError
from tierstream.metadata.bookie_registry import set_bookie_endpoint
from tierstream.readers import ReadStats, open_reader
from tierstream.readers.stats import BROKER_FALLBACK, ENDPOINT, LOCAL
from tierstream.splits.split import ReaderKind, Split

from ..logs import TOPIC, Log, fill, running_log


def _bookie_splits(log: Log, key_ranges: int = 1) -> list[Split]:
    for plog in log.store.partitions(TOPIC):
        plog.seal()
    with Enumerator(data_dir=log.data_dir, broker=log.url) as enum:
        splits = [s for s in enum.plan(Query(topics=(TOPIC,), key_ranges=key_ranges))
                  if s.reader is ReaderKind.BOOKIE]
    assert splits
    return splits


def _elsewhere(split: Split) -> Split:
    """The split as a host that cannot see the store's files gets it."""
    return replace(split, replicas=tuple(replace(r, local_dir=None) for r in split.replicas))


def _read(splits: list[Split], stats: ReadStats | None = None, **kw: object
          ) -> list[tuple[int, int, int, int, bytes]]:
    rows = []
    for split in splits:
        for batch in open_reader(split, stats=stats, **kw):  # type: ignore[arg-type]
            t = pa.Table.from_batches([batch])
            rows.extend(zip(*(t.column(c).to_pylist() for c in
                              ("partition", "segment_id", "entry_id", "batch_index", "value")),
                            strict=True))
    return rows


def test_a_bookie_split_off_the_store_host_is_read_from_the_bookie_endpoints(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", bookie_endpoints=True, maxEntriesPerSegment=4) as log:
        fill(log, partitions=2, batches=9)
        splits = _bookie_splits(log)
        assert all(r.endpoint and r.local_dir for s in splits for r in s.replicas)
        here, remote = ReadStats(), ReadStats()
        local_rows = _read(splits, here)
        remote_rows = _read([_elsewhere(s) for s in splits], remote)
        assert remote_rows == local_rows and local_rows  # same rows, same (log) order
        assert here.rows(path=LOCAL) == len(local_rows) == remote.rows(path=ENDPOINT)
        assert remote.rows(path=BROKER_FALLBACK) == 0 == remote.rows(path=LOCAL)
        assert "bookie-log via bookie endpoint" in remote.summary()


def test_key_ranges_are_filtered_on_the_bookie_so_the_wire_carries_about_one_copy(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", bookie_endpoints=True, maxEntriesPerSegment=50) as log:
        # entries of 400 messages: each filtered entry still costs its own frame and IPC
        # header (~0.7 KiB), which entries of a few tiny messages would be dominated by
        fill(log, partitions=1, batches=20, n=400, keys=400)
        (endpoint,) = log.endpoints
        whole = _read([_elsewhere(s) for s in _bookie_splits(log)])
        sent_whole = endpoint.bytes_served
        ranged = _read([_elsewhere(s) for s in _bookie_splits(log, key_ranges=4)])
        sent_ranged = endpoint.bytes_served - sent_whole
        assert sorted(ranged) == sorted(whole)
        # every frame went out 4 times before filtering on the bookie; now about once
        assert sent_ranged <= 1.25 * sent_whole, (sent_ranged, sent_whole)


def _corrupt_entry(bookie_dir: str, segment_id: int, entry: int) -> None:
    log_path, idx_path = ledger_paths(bookie_dir, segment_id)
    rec = read_index(idx_path)[entry]
    with open(log_path, "r+b") as f:
        f.seek(rec.frame_offset + rec.frame_len - 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_frame_corrupt_on_one_bookie_is_caught_by_the_reader_and_read_from_another(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", bookie_endpoints=True, bookies=3, writeQuorum=3,
                     ackQuorum=2, maxEntriesPerSegment=6) as log:
        fill(log, partitions=1, batches=6)
        splits = _bookie_splits(log)
        before = _read(splits)
        first = splits[0]
        _corrupt_entry(first.replicas[0].local_dir or "", first.segment_id, 1)
        for key_ranges in (1, 2):  # raw frames, and frames filtered on the bookie
            remote = [_elsewhere(s) for s in _bookie_splits(log, key_ranges)]
            assert sorted(_read(remote)) == sorted(before)
        # the same frame bad on every replica: an error naming the entry, not wrong rows
        for r in first.replicas[1:]:
            _corrupt_entry(r.local_dir or "", first.segment_id, 1)
        with pytest.raises(CorruptionError, match=rf"entry 1 of segment {first.segment_id} "
                                                  r".*unreadable on every replica"):
            _read([_elsewhere(first)])


def test_an_endpoint_that_is_another_bookie_is_not_read_for_the_replica(tmp_path: Path
                                                                      ) -> None:
    """Regression: a replica's address answered by another bookie's endpoint (its port taken
    while the bookie was down, here by another store's bookie-1) was read as if it were the
    replica: that store's ledger of the same id, wrong rows. Now the request names the
    bookie, the endpoint refuses it and the next replica is read."""
    with running_log(tmp_path / "data", bookie_endpoints=True, bookies=2, writeQuorum=2,
                     ackQuorum=2, maxEntriesPerSegment=6) as log, \
            running_log(tmp_path / "other", bookie_endpoints=True, bookies=2, writeQuorum=2,
                        ackQuorum=2, maxEntriesPerSegment=6) as other:
        fill(log, partitions=1, batches=6)
        fill(other, partitions=1, batches=6, n=7)
        splits = [_elsewhere(s) for s in _bookie_splits(log)]
        before = _read(splits)
        _bookie_splits(other)
        wrong = other.endpoints[1].url  # the other store's bookie-1
        assert all(s.replicas[0].bookie == "bookie-0" for s in splits)
        moved = [replace(s, replicas=(replace(s.replicas[0], endpoint=wrong),
                                      *s.replicas[1:])) for s in splits]
        stats = ReadStats()
        assert _read(moved, stats) == before
        assert stats.rows(path=ENDPOINT) == len(before)


def test_local_files_a_corrupt_or_missing_first_replica_is_read_from_the_next(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", bookies=3, writeQuorum=3, ackQuorum=2,
                     maxEntriesPerSegment=6) as log:
        fill(log, partitions=1, batches=6)
        splits = _bookie_splits(log)
        before = _read(splits)
        first = splits[0]
        _corrupt_entry(first.replicas[0].local_dir or "", first.segment_id, 1)
        stats = ReadStats()
        assert _read(splits, stats) == before  # same rows, same order, from local files
        assert stats.rows(path=LOCAL) == len(before)
        log_path, _ = ledger_paths(first.replicas[0].local_dir or "", first.segment_id)
        log_path.unlink()  # the first replica's ledger gone, its index still there
        assert _read(splits) == before
        for r in first.replicas[1:]:
            _corrupt_entry(r.local_dir or "", first.segment_id, 1)
        with pytest.raises(CorruptionError, match=rf"entry 1 of segment {first.segment_id} "
                                                  r".*unreadable on every replica"):
            _read([first])


def test_a_segment_that_left_the_bookies_after_planning_is_read_through_the_broker(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data", bookie_endpoints=True, maxEntriesPerSegment=5) as log:
        fill(log, partitions=1, batches=4)
        splits = _bookie_splits(log)
        before = _read(splits)
        plog = log.store.partitions(TOPIC)[0]
        for seg in plog.closed_segments():  # offloaded, and the bookie copies deleted
            log.store.offloader.offload_segment(plog, seg)
            log.store.bookies["bookie-0"].delete_ledger(seg.segment_id)
        stats = ReadStats()
        assert sorted(_read([_elsewhere(s) for s in splits], stats)) == sorted(before)
        assert stats.rows(path=BROKER_FALLBACK) == len(before)
        assert stats.rows(path=ENDPOINT) == 0


def test_bookie_endpoints_take_the_token_like_the_broker(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=5) as log:
        fill(log, partitions=1, batches=3)
        server = BookieServer(log.store.bookies["bookie-0"].root, bookie_id="bookie-0",
                              auth_token="s3cret")
        threading.Thread(target=server.serve, daemon=True).start()
        try:
            set_bookie_endpoint(log.store.metadata, "bookie-0", server.url)
            splits = [_elsewhere(s) for s in _bookie_splits(log)]
            with pytest.raises(AuthError, match=r"bookie endpoint of bookie-0 .* denied"):
                _read(splits)
            assert _read(splits, auth_token="s3cret")
        finally:
            server.shutdown()


_READY = re.compile(r"listening on (\S+)")


def _serve(bookie_dir: Path, broker: str) -> tuple[subprocess.Popen[str], str]:
    """``tierstream bookie serve`` on its own, registered with ``broker``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstream", "bookie", "serve", "--dir", str(bookie_dir),
         "--broker", broker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until ready or exit; the test timeout bounds it
    match = _READY.search(line)
    if match is None:
        proc.kill()
        raise AssertionError(f"bookie serve did not start: {line!r} {proc.stderr.read()!r}"
                             if proc.stderr else line)
    return proc, match.group(1)


@pytest.fixture
def served() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_bookie_endpoint_killed_mid_read_and_the_read_completes_on_another_replica(
        tmp_path: Path, served: list[subprocess.Popen[str]],
        caplog: pytest.LogCaptureFixture) -> None:
    with running_log(tmp_path / "data", bookies=3, writeQuorum=3, ackQuorum=2,
                     maxEntriesPerSegment=100_000) as log:
        # ~20 MB of frames: more than gRPC buffers ahead of the reader, so the kill lands
        # while most of the stream is still to come
        fill(log, partitions=1, batches=800, n=400)
        for bookie_id, bookie in sorted(log.store.bookies.items()):
            proc, url = _serve(bookie.root, log.url)
            served.append(proc)
            assert log.store.metadata.bookie_endpoints()[bookie_id] == url
        (split,) = [_elsewhere(s) for s in _bookie_splits(log)]
        expected = _read([split])
        stats = ReadStats()
        rows = []
        reader = open_reader(split, stats=stats)
        for i, batch in enumerate(reader):
            if i == 0:  # the first replica's endpoint dies while the stream is open
                os.kill(served[0].pid, signal.SIGKILL)
                served[0].wait()
            t = pa.Table.from_batches([batch])
            rows.extend(zip(*(t.column(c).to_pylist() for c in
                              ("partition", "segment_id", "entry_id", "batch_index", "value")),
                            strict=True))
        assert rows == expected and len(rows) == 320_000
        assert stats.rows(path=ENDPOINT) == len(rows)
        # it did continue elsewhere (the stream was not already all buffered here)
        assert any("continuing on another replica" in r.getMessage() for r in caplog.records)


def test_splits_planned_before_a_broker_restart_find_the_endpoints_where_they_moved(
        start_broker: Any, free_port: int, tmp_path: Path) -> None:
    from tierstream.client.admin import Admin
    from tierstream.client.producer import Producer

    broker = start_broker("--max-entries-per-segment", "2", port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
        for i in range(5):
            with Producer(TOPIC, broker=broker.url) as producer:
                producer.send_many({"value": f"v{i}-{j}"} for j in range(20))
        before = admin.bookie_endpoints()
    # planned on a host without the files: replicas name endpoints only
    with Enumerator(broker=broker.url) as enum:
        splits = [s for s in enum.plan(Query(topics=(TOPIC,)))
                  if s.reader is ReaderKind.BOOKIE]
    assert splits and all(r.local_dir is None for s in splits for r in s.replicas)
    expected = _read(splits)
    broker.stop()
    broker = start_broker("--max-entries-per-segment", "2", port=free_port)
    with Admin(broker.url) as admin:
        assert admin.bookie_endpoints() != before  # a new free port each start
    stats = ReadStats()
    assert _read(splits, stats) == expected
    assert stats.rows(path=ENDPOINT) == len(expected) and not stats.rows(path=BROKER_FALLBACK)


def test_bookie_port_base_gives_each_bookie_a_fixed_port(start_broker: Any, free_port: int
                                                         ) -> None:
    from tierstream.client.admin import Admin

    broker = start_broker("--bookies", "2", "--bookie-port-base", str(free_port))
    with Admin(broker.url) as admin:
        assert admin.bookie_endpoints() == {
            "bookie-0": f"grpc://127.0.0.1:{free_port}",
            "bookie-1": f"grpc://127.0.0.1:{free_port + 1}"}
