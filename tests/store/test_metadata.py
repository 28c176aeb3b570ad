"""The metadata store's schema migration: a store written by the previous version opens."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tierstream.broker.subscriptions.cursor_state import CursorState
from tierstream.errors import ConfigError
from tierstream.metadata.store import MetadataStore
from tierstream.metadata.tables import SCHEMA_VERSION
from tierstream.model.names import TopicName
from tierstream.model.positions import Position


def test_a_version_6_store_gains_tier_sizes_and_keeps_its_segments(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    store = MetadataStore(path)
    _, (seg,) = store.create_topic(TopicName.parse("a/b/c"), 1, created_at=1,
                                   ensembles=[("bookie-0",)])
    store.close()
    with sqlite3.connect(path) as c:  # as version 6 wrote it: no tier_bytes column
        c.execute("ALTER TABLE segments DROP COLUMN tier_bytes")
        c.execute("UPDATE meta SET value='6' WHERE key='schema_version'")
    c.close()
    store = MetadataStore(path)
    try:
        assert store.get_segment(seg.segment_id).tier_bytes is None  # unknown: read with a HEAD
        store.flip_to_tier(seg.segment_id, "file:///t/1.parquet", offloaded_at=2, tier_bytes=99)
        assert store.get_segment(seg.segment_id).tier_bytes == 99
    finally:
        store.close()


def test_a_version_17_store_reads_a_retention_stored_as_text(tmp_path: Path) -> None:
    """Before: ``Admin.set_retention(t, "30d")`` of an older version stored the text, and
    every topic listing failed (``divmod()``) as did the broker's tier pass. Opened to write,
    a readable duration becomes milliseconds and anything else no retention (kept, not
    deleted)."""
    path = tmp_path / "metadata.db"
    store = MetadataStore(path)
    for name in ("a/b/days", "a/b/half", "a/b/odd", "a/b/fine"):
        store.create_topic(TopicName.parse(name), 1, created_at=1, ensembles=[("bookie-0",)])
    store.close()
    with sqlite3.connect(path) as c:  # as an older version let a client store them
        c.executemany("UPDATE topics SET retention_ms=? WHERE name=?",
                      [("30d", "a/b/days"), (1.5, "a/b/half"), ("7 parsecs", "a/b/odd"),
                       (3_600_000, "a/b/fine")])
        c.execute("UPDATE meta SET value='17' WHERE key='schema_version'")
    c.close()
    store = MetadataStore(path)
    try:
        assert {t.name: t.retention_ms for t in store.list_topics()} == {
            "a/b/days": 30 * 86_400_000, "a/b/half": None, "a/b/odd": None,
            "a/b/fine": 3_600_000}
    finally:
        store.close()


def test_a_version_7_store_keeps_its_cursors_as_mark_delete_positions(tmp_path: Path) -> None:
    """Version 7 kept, per key range, the next position to read (cumulative acks only): the
    lowest of them is where everything is acknowledged up to."""
    path = tmp_path / "metadata.db"
    MetadataStore(path).close()
    ranges = [[0, 32768, Position(0, 4, 7, 0).to_dict()],
              [32768, 65536, Position(0, 3, 9, 2).to_dict()]]
    with sqlite3.connect(path) as c:  # as version 7 wrote it
        c.execute("ALTER TABLE cursors RENAME COLUMN state TO intervals")
        c.execute("INSERT INTO cursors (topic, subscription, partition, intervals, updated_at) "
                  "VALUES ('a/b/c', 'billing', 0, ?, 1)", (json.dumps(ranges),))
        c.execute("UPDATE meta SET value='7' WHERE key='schema_version'")
    c.close()
    store = MetadataStore(path)
    try:
        state = CursorState.from_json(store.get_cursor("a/b/c", "billing", 0), 0)
        assert state.mark_delete == Position(0, 3, 9, 2)
        assert state.acked == [] and state.type is None  # the first consumer sets the type
    finally:
        store.close()


def test_planning_reads_a_window_by_index_never_by_scanning_the_topic(tmp_path: Path) -> None:
    """The join order is fixed (CROSS JOIN): left to itself, SQLite chose, for the same
    statement without its ORDER BY, to walk every segment of the topic for each partition
    (33 s instead of 20 ms at 1,000 x 1,000 segments)."""
    store = MetadataStore(tmp_path / "metadata.db")
    try:
        store.create_topic(TopicName.parse("a/b/c"), 3, created_at=1,
                           ensembles=[("bookie-0",)] * 3)
        statements: list[str] = []
        store.backend._conn.set_trace_callback(statements.append)
        store.segments_in_windows("a/b/c", [0, 1, 2], 10, 20)
        store.backend._conn.set_trace_callback(None)
        (sql,) = [s for s in statements if "json_each" in s]
        plan = [row[3] for row in store.backend._conn.execute("EXPLAIN QUERY PLAN " + sql)]
        assert not [step for step in plan if step.startswith("SCAN s")
                    or step.startswith("SCAN segments")], plan
        assert any("segments_by_partition" in step for step in plan), plan
    finally:
        store.close()


def test_a_planner_on_a_store_not_yet_upgraded_is_told_how_to_upgrade_it(
        tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    MetadataStore(path).close()
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='6' WHERE key='schema_version'")
    c.close()
    with pytest.raises(ConfigError, match=rf"has schema version 6; this tierstream reads "
                                          rf"version {SCHEMA_VERSION}: the broker upgrades it "
                                          r"when it starts: run `tierstream broker start "
                                          r"--data-dir "):
        MetadataStore(path, read_only=True)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    c.close()
    with pytest.raises(ConfigError, match="written by a newer tierstream: upgrade this one"):
        MetadataStore(path, read_only=True)


def test_a_version_8_store_opens_without_scale_events_and_can_grow(tmp_path: Path) -> None:
    from tierstream.metadata.scale_events import record_scale_event

    path = tmp_path / "metadata.db"
    store = MetadataStore(path)
    store.create_topic(TopicName.parse("a/b/c"), 2, created_at=1, ensembles=[("bookie-0",)] * 2)
    store.close()
    with sqlite3.connect(path) as c:  # as version 8 wrote it: no scale_events table
        c.execute("DROP TABLE scale_events")
        c.execute("UPDATE meta SET value='8' WHERE key='schema_version'")
    c.close()
    store = MetadataStore(path)
    try:
        topic = store.get_topic("a/b/c")
        assert topic.partitions == 2 and topic.scale_events == () and not topic.lineage
        grown, opened = record_scale_event(store, "a/b/c", 2, 4, at=5, reason="admin",
                                           ensembles=[("bookie-0",)] * 4)
        assert [s.partition for s in opened] == [0, 1, 2, 3]
        (event,) = grown.scale_events
        assert (event.old, event.new, event.first_segment_id) == (2, 4, opened[0].segment_id)
        assert grown.lineage.parent(3) == (1, event) and grown.lineage.root(3) == 1
        assert store.query("SELECT value FROM meta WHERE key='schema_version'") == [
            (str(SCHEMA_VERSION),)]
    finally:
        store.close()


def test_a_version_9_store_gains_skipped_entries_and_set_aside_transactions(tmp_path: Path
                                                                             ) -> None:
    from tierstream.metadata.records import SegmentState
    from tierstream.metadata.transaction_records import TransactionRecords

    path = tmp_path / "metadata.db"
    store = MetadataStore(path)
    _, (seg,) = store.create_topic(TopicName.parse("a/b/c"), 1, created_at=1,
                                   ensembles=[("bookie-0",)])
    store.close()
    with sqlite3.connect(path) as c:  # as version 9 wrote it
        c.execute("DROP TABLE txn_set_aside")
        c.execute("ALTER TABLE segments DROP COLUMN skipped")
        c.execute("ALTER TABLE bookie_endpoints DROP COLUMN instance")
        c.execute("DROP TABLE under_replicated")
        c.execute("ALTER TABLE bookie_endpoints DROP COLUMN host")
        c.execute("ALTER TABLE bookie_endpoints DROP COLUMN writable")
        c.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
    c.close()
    store = MetadataStore(path)
    try:
        (old,) = store.segments("a/b/c")
        assert old.segment_id == seg.segment_id and old.skipped == ()
        sealed = old.with_stats(state=SegmentState.CLOSED, entries=3, messages=5,
                                skipped=((1, 2),))
        store.seal_segment(sealed, {}, {"t1": [[1, 4, None]]})
        assert store.segments("a/b/c")[0].skipped == ((1, 2),)
        txns = TransactionRecords(store)
        assert txns.set_aside("t1") == [("a/b/c", 0, seg.segment_id, [[1, 4, None]])]
        assert txns.set_aside_segments() == {seg.segment_id}
        assert txns.has_set_aside("t1", "a/b/c", 0) and not txns.has_set_aside("t1", "a/b/c", 1)
        txns.drop_set_aside(["t1"])
        assert txns.set_aside("t1") == [] and txns.set_aside_segments() == set()
        assert store.query("SELECT value FROM meta WHERE key='schema_version'") == [
            (str(SCHEMA_VERSION),)]
        # v11: network bookies say which host they are on and that they take writes
        assert {"host", "writable"} <= set(store.backend.columns("bookie_endpoints"))
        # v12: a bookie's identity (its cookie's instance), and which segments lack a copy
        assert "instance" in store.backend.columns("bookie_endpoints")
        assert store.query("SELECT COUNT(*) FROM under_replicated") == [(0,)]
    finally:
        store.close()
