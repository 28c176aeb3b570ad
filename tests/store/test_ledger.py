"""The ledger file format and the bookie's group commit, on real files."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from tierstream.bookie.ledger import decode_payload, read_index, scan_frames
from tierstream.bookie.storage import Bookie, ledger_paths
from tierstream.errors import ConflictError, CorruptionError
from tierstream.model.message_format import MESSAGE_SCHEMA

from ..timing import scaled


def _entry(segment_id: int, entry_id: int, n: int = 5) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "key": [f"k{i}" for i in range(n)], "key_hash": [i for i in range(n)],
        "value": [f"v{entry_id}-{i}".encode() for i in range(n)],
        "publish_time": [1000 + entry_id * 10 + i for i in range(n)], "event_time": [None] * n,
        "properties": [None] * n, "partition": [0] * n, "segment_id": [segment_id] * n,
        "entry_id": [entry_id] * n, "batch_index": list(range(n)),
    }, schema=MESSAGE_SCHEMA)


def _write(bookie: Bookie, segment_id: int, entries: int) -> None:
    bookie.create_ledger(segment_id)
    futures = []
    for e in range(entries):
        batch = _entry(segment_id, e)
        futures.append(bookie.append(segment_id, e, {"p": "x", "s": e}, batch.serialize(),
                                     batch.num_rows, 1000 + e * 10, 1004 + e * 10))
    for f in futures:
        f.result(timeout=scaled(10))


def test_frames_round_trip_with_index_and_meta(tmp_path: Path) -> None:
    bookie = Bookie("b0", tmp_path)
    try:
        _write(bookie, 7, 20)
        bookie.seal_ledger(7, 19)
        records = bookie.index(7)
        assert [r.entry_id for r in records] == list(range(20))
        assert records == read_index(ledger_paths(tmp_path, 7)[1])
        got = [decode_payload(p) for _, p in bookie.read_entries(7, records)]
        assert got == [_entry(7, e) for e in range(20)]
        frames, length = scan_frames(ledger_paths(tmp_path, 7)[0], 7)
        assert [f.meta for f in frames] == [{"p": "x", "s": e} for e in range(20)]
        assert length == ledger_paths(tmp_path, 7)[0].stat().st_size
    finally:
        bookie.close()


def test_a_copy_stays_a_prefix_of_its_ledger_when_an_entry_failed_there(
        tmp_path: Path) -> None:
    """Regression (cluster_chaos, 100 faults): an entry that failed on one bookie (its stream
    broke) was followed there by the next ones, written where the failed one would be. That
    copy's offsets then differed from the others', and a writer's index holds the offsets of
    whichever bookie answered first: after the copy was re-replicated, an entry was
    "unreadable on every replica: bad frame magic". An entry that does not follow the last
    one written is refused: every copy is a prefix, each frame at the same offset on each."""
    bookie = Bookie("b0", tmp_path)
    try:
        _write(bookie, 3, 2)  # entries 0 and 1

        def append(entry_id: int) -> object:
            batch = _entry(3, entry_id)
            return bookie.append(3, entry_id, {}, batch.serialize(), batch.num_rows,
                                 1000, 1004).result(timeout=scaled(10))
        for missed in (3, 1):  # entry 2 never came (a gap), entry 1 again (a duplicate)
            with pytest.raises(ConflictError, match=f"takes entry 2 next, not {missed}"):
                append(missed)
        append(2)
        bookie.seal_ledger(3, 2)
        assert [r.entry_id for r in bookie.index(3)] == [0, 1, 2]
        frames, _ = scan_frames(ledger_paths(tmp_path, 3)[0], 3)
        assert [(f.record.entry_id, f.record.frame_offset) for f in frames] == \
            [(r.entry_id, r.frame_offset) for r in bookie.index(3)]  # each where it is
    finally:
        bookie.close()


def test_a_frame_in_the_wrong_ledger_fails_the_id_check(tmp_path: Path) -> None:
    bookie = Bookie("b0", tmp_path)
    try:
        _write(bookie, 1, 3)
        bookie.seal_ledger(1, 2)
        log1, idx1 = ledger_paths(tmp_path, 1)
        log2, idx2 = ledger_paths(tmp_path, 2)
        log2.write_bytes(log1.read_bytes())
        idx2.write_bytes(idx1.read_bytes())
        with pytest.raises(CorruptionError, match="expected segment 2"):
            list(bookie.read_entries(2, bookie.index(2)))
    finally:
        bookie.close()


def test_scan_stops_at_a_torn_frame(tmp_path: Path) -> None:
    bookie = Bookie("b0", tmp_path)
    try:
        _write(bookie, 3, 10)
    finally:
        bookie.close()
    log, _ = ledger_paths(tmp_path, 3)
    with open(log, "r+b") as f:
        f.truncate(log.stat().st_size - 5)
    frames, valid = scan_frames(log, 3)
    assert len(frames) == 9 and valid < log.stat().st_size


def test_concurrent_appends_share_fsyncs_and_all_complete(tmp_path: Path) -> None:
    bookie = Bookie("b0", tmp_path)
    try:
        for s in range(4):
            bookie.create_ledger(s)
        errors: list[BaseException] = []

        def producer(s: int) -> None:
            try:
                for e in range(50):
                    batch = _entry(s, e)
                    bookie.append(s, e, {}, batch.serialize(), 5, 0, 0).result(timeout=scaled(10))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert all(len(bookie.index(s)) == 50 for s in range(4))
    finally:
        bookie.close()


def test_entries_before_finds_the_first_entry_reaching_a_time() -> None:
    from tierstream.bookie.ledger import IndexRecord, entries_before

    # entries cover [0,9], [10,19], [20,29] (first, last publish time)
    records = [IndexRecord(i, 0, 0, 10, 10 * i, 10 * i + 9) for i in range(3)]
    assert [entries_before(records, t) for t in (0, 9, 10, 15, 29, 30)] == [0, 0, 1, 1, 2, 3]
    assert [entries_before(records, t, by="first") for t in (0, 5, 10, 21, 30)] == [
        0, 1, 1, 3, 3]


def _ledger_fds(path: Path) -> int:
    """Descriptors of this process open on ledger files under ``path``."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(h.startswith(str(path)) and h.endswith(".log") for h in held)


def test_reads_of_ledger_files_share_one_descriptor_each_and_keep_few(tmp_path: Path) -> None:
    """Issue 80: every reader of a ledger (a dispatcher, a broker read stream, a remote
    reader) opened a file of its own: 50 reads of one segment held 50 descriptors, and reads
    of 20 segments kept as many as were under way. Now one per file, and at most
    ``max_open`` kept once no read uses them; a deleted ledger's file is closed at once."""
    bookie = Bookie("b0", tmp_path, max_open=4)
    try:
        for segment_id in range(20):
            _write(bookie, segment_id, 3)
            bookie.seal_ledger(segment_id, 2)
        readers = [bookie.open_reader(7) for _ in range(50)]
        records = bookie.index(7)
        assert all(decode_payload(r.read(records[1])) == _entry(7, 1) for r in readers)
        assert _ledger_fds(tmp_path) == 1  # before: 50
        for reader in readers:
            reader.close()
        for segment_id in range(20):
            assert len(list(bookie.read_entries(segment_id, bookie.index(segment_id)))) == 3
        assert _ledger_fds(tmp_path) <= 4
        bookie.delete_ledger(19)  # the last read: kept open until deleted
        assert _ledger_fds(tmp_path) <= 3
    finally:
        bookie.close()
    assert _ledger_fds(tmp_path) == 0
