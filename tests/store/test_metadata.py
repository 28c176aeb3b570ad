"""The metadata store's schema migration: a store written by the previous version opens."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tierstream.names import TopicName
from tierstream.store.metadata import SCHEMA_VERSION, MetadataStore


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
        assert SCHEMA_VERSION == 7
        assert store.get_segment(seg.segment_id).tier_bytes is None  # unknown: read with a HEAD
        store.flip_to_tier(seg.segment_id, "file:///t/1.parquet", offloaded_at=2, tier_bytes=99)
        assert store.get_segment(seg.segment_id).tier_bytes == 99
    finally:
        store.close()
