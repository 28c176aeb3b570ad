"""The metadata store: topics, segment records, cursors and de-duplication snapshots.

SQLite in WAL mode, one file in the data directory. The broker and its offloader write;
planners and the CLI read, each from its own connection, possibly in another process. Everything
goes through :class:`MetadataStore` so that a networked SQL database can replace SQLite later.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from tierstream.errors import AlreadyExistsError, ConfigError, NotFoundError
from tierstream.metadata.backend import (
    POSTGRES_SCHEMES,
    Backend,
    SqliteBackend,
    Tx,
    UniqueViolation,
)
from tierstream.metadata.compactions import compactions_of
from tierstream.metadata.cursor_rows import CursorRows
from tierstream.metadata.records import SegmentRecord, SegmentState, TopicRecord
from tierstream.metadata.segment_rows import (
    SEGMENT_COLUMNS,
    SEGMENT_FIELDS,
    Holder,
    insert_segments,
    owners_changed,
    save_dedup,
    segment_of_row,
    update_stats,
)
from tierstream.metadata.tables import SCHEMA_VERSION, create_and_migrate
from tierstream.metadata.tier_rows import TierRows
from tierstream.model.lineage import ScaleEvent
from tierstream.model.names import TopicName
from tierstream.model.topic_rules import check_new_topic, check_partition_count, check_retention
from tierstream.schemas.model import SchemaInfo, SchemaType

__all__ = ["SEGMENT_COLUMNS", "MetadataStore", "segment_of_row"]

log = logging.getLogger(__name__)
_TOPIC = "name, partitions, retention_ms, created_at, key_routing, announced, announced_at"



def open_backend(where: str | Path, *, read_only: bool = False,
                 takeover_after_s: float | None = None, hold: bool = True,
                 on_standby: Callable[[], None] | None = None) -> Backend:
    """The backend ``where`` names: a ``postgresql://`` URL, or the path of a SQLite file.
    PostgreSQL only: ``takeover_after_s``, a standby (``on_standby()`` once it waits);
    ``hold=False``, a writer that is not the broker (a bookie registering itself)."""
    if str(where).startswith(POSTGRES_SCHEMES):
        from tierstream.metadata.postgres import PostgresBackend

        backend: Backend = PostgresBackend(str(where), read_only=read_only,
                                           takeover_after_s=takeover_after_s, hold=hold,
                                           on_standby=on_standby)
        return backend
    return SqliteBackend(where, read_only=read_only)


class MetadataStore(TierRows, CursorRows):
    """The metadata: topics, segments, cursors, de-duplication, schemas, transactions, scale
    events, on a :class:`~tierstream.metadata.backend.Backend` (``where``: the SQLite file,
    default; or a ``postgresql://`` URL, ``postgres.py``). Thread-safe.

    ``read_only=True`` is for planners and the CLI: it never creates or migrates anything.
    """

    def __init__(self, where: str | Path, *, read_only: bool = False,
                 takeover_after_s: float | None = None, hold: bool = True,
                 on_standby: Callable[[], None] | None = None) -> None:
        self.backend: Backend = open_backend(where, read_only=read_only,
                                             takeover_after_s=takeover_after_s, hold=hold,
                                             on_standby=on_standby)
        #: the broker writing here, once it claimed its partitions (``ownership.py``): every
        #: new segment and every seal is checked against a partition's owner in its
        #: transaction; None for readers and for tests of the tables alone
        self.owner: Holder | None = None
        self.path = where if isinstance(where, Path) else Path(where) \
            if not str(where).startswith(POSTGRES_SCHEMES) else None
        try:
            if not read_only:
                with self.backend.transaction() as c:
                    create_and_migrate(c, self.backend)
            self._check_version()
        except BaseException:
            self.backend.close()
            raise

    def _check_version(self) -> None:
        row = self._one("SELECT value FROM meta WHERE key='schema_version'")
        if row is None or int(row[0]) != SCHEMA_VERSION:
            found = None if row is None else int(row[0])
            if found is not None and found < SCHEMA_VERSION:
                on = f"--data-dir {self.path.parent}" if self.path is not None \
                    else f"--metadata {self.backend.name}"
                advice = ("the broker upgrades it when it starts: run `tierstream broker start "
                          f"{on}` once")
            else:
                advice = "it was written by a newer tierstream: upgrade this one"
            raise ConfigError(
                f"metadata store {self.backend.name!r} has schema version {found!r}; this "
                f"tierstream reads version {SCHEMA_VERSION}: {advice}"
            )

    def close(self) -> None:
        self.backend.close()

    def atomic(self) -> AbstractContextManager[Tx]:
        """One write transaction (here, and for the tables another module keeps:
        ``transactions`` and ``sinks``, ``schemas``, ``scale_events``)."""
        return self.backend.transaction()  # type: ignore[no-any-return]

    def query(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        """Rows of one read statement (here, and for the same modules)."""
        return self.backend.read(sql, args)

    def _one(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> Any:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    # -- topics -------------------------------------------------------------------------------

    def create_topic(
        self, name: TopicName, partitions: int, *, created_at: int, retention_ms: int | None = None,
        ensembles: list[tuple[str, ...]] | None = None,
        placed: Mapping[int, tuple[str, int]] | None = None,
    ) -> tuple[TopicRecord, list[SegmentRecord]]:
        """Register a topic and, in the same transaction, the first open segment of each
        partition (on ``ensembles[p]``): a topic exists whole or not at all. A partition
        ``placed`` on another broker (several brokers: ``{partition: (broker, epoch)}``) is
        owned by it from the same transaction, and gets its first segment there."""
        name, retention_ms = check_new_topic(name), check_retention(retention_ms)
        check_partition_count(partitions, name)
        try:
            with self.atomic() as c:
                c.execute(
                    "INSERT INTO topics (name, partitions, retention_ms, created_at) "
                    "VALUES (?, ?, ?, ?)",
                    (str(name), partitions, retention_ms, created_at),
                )
                placed = placed or {}
                if placed:
                    c.executemany(
                        "INSERT INTO partition_owners (topic, partition, broker_id, epoch, "
                        "claimed_at) VALUES (?, ?, ?, ?, ?)",
                        [(str(name), p, b, e, created_at) for p, (b, e) in placed.items()])
                    owners_changed(c)
                segments = insert_segments(c, str(name), [
                    (p, e) for p, e in enumerate(ensembles or []) if p not in placed],
                    created_at, self.owner)
        except UniqueViolation:
            raise AlreadyExistsError(f"topic {str(name)!r} already exists") from None
        return TopicRecord(
            name=str(name), partitions=partitions, retention_ms=retention_ms, created_at=created_at
        ), segments

    def mark_topic_deleting(self, name: str, *, now: int) -> None:
        """From now on the topic is gone for everyone; its data is purged next."""
        with self.atomic() as c:
            c.execute("UPDATE topics SET deleting_at=? WHERE name=? AND deleting_at IS NULL",
                      (now, name))

    def topics_being_deleted(self) -> list[TopicRecord]:
        return self._topics(self.query(f"SELECT {_TOPIC} FROM topics WHERE deleting_at IS NOT "
                                       "NULL ORDER BY name"))

    def purge_topic(self, name: str) -> None:
        """Remove every record of a topic, in one transaction (the last step of deleting)."""
        with self.atomic() as c:
            for table in ("segments", "cursors", "deleted_segments", "dedup", "schemas",
                          "schema_policies", "scale_events", "txn_set_aside",
                          "partition_owners", "compactions", "compaction_policies"):
                c.execute(f"DELETE FROM {table} WHERE topic=?", (name,))
            c.execute("DELETE FROM topics WHERE name=?", (name,))
            owners_changed(c)

    def get_topic(self, name: TopicName | str) -> TopicRecord:
        row = self._one(f"SELECT {_TOPIC} FROM topics WHERE name = ? AND deleting_at IS NULL",
                        (str(name),))
        if row is None:
            raise NotFoundError(f"topic {str(name)!r} does not exist")
        return self._topics([row])[0]

    def list_topics(self, namespace: str | None = None) -> list[TopicRecord]:
        if namespace is None:
            rows = self.query(f"SELECT {_TOPIC} FROM topics WHERE deleting_at IS NULL "
                              "ORDER BY name")
        else:
            rows = self.query(
                f"SELECT {_TOPIC} FROM topics WHERE name LIKE ? ESCAPE '\\' AND deleting_at "
                "IS NULL ORDER BY name",
                (namespace.replace("_", "\\_").replace("%", "\\%") + "/%",))
        return self._topics(rows)

    def _topics(self, rows: Sequence[Any]) -> list[TopicRecord]:
        """Records of ``topics`` rows (:data:`_TOPIC`), each with its scale events (one
        more read)."""
        events: dict[str, list[ScaleEvent]] = {}
        if rows:
            names = [r[0] for r in rows]
            found = self.query(
                "SELECT topic, seq, old_partitions, new_partitions, first_segment_id, at, "
                f"reason FROM scale_events WHERE topic IN ({', '.join('?' * len(names))}) "
                "ORDER BY topic, seq", names)
            for t, *fields in found:
                events.setdefault(t, []).append(ScaleEvent(*fields))
        return [TopicRecord(name=r[0], partitions=r[1], retention_ms=r[2], created_at=r[3],
                            scale_events=tuple(events.get(r[0], ())),
                            key_routing=r[4] or "tierstream", announced=r[5],
                            announced_at=r[6]) for r in rows]


    # -- segments -----------------------------------------------------------------------------

    def new_segment(
        self, topic: str, partition: int, *, ensemble: tuple[str, ...], created_at: int
    ) -> SegmentRecord:
        (record,) = self.new_segments(topic, [(partition, ensemble)], created_at=created_at)
        return record

    def new_segments(self, topic: str, partitions: list[tuple[int, tuple[str, ...]]], *,
                     created_at: int) -> list[SegmentRecord]:
        """A new open segment for each ``(partition, ensemble)``, in one transaction."""
        with self.atomic() as c:
            return insert_segments(c, topic, partitions, created_at, self.owner)

    def update_segment_stats(self, record: SegmentRecord) -> None:
        """Write an open segment's live entries/messages/bytes/min/max; never to a sealed
        one (its final record is the seal's)."""
        with self.atomic() as c:
            update_stats(c, record, only_open=True)

    def seal_segment(self, record: SegmentRecord, dedup: Mapping[str, tuple[int, Any]],
                     set_aside: Mapping[str, list[list[Any]]] | None = None) -> None:
        """Seal a segment (``record``: CLOSED, final stats, skipped entries), save the
        partition's producer de-dup state (``managed_ledger/dedup.py``) and the entries of
        undecided transactions ``set_aside`` here (``[entry_id, rows, routed]`` each) in
        **one** transaction: a crash leaves all or none."""
        with self.atomic() as c:
            if self.owner is not None:
                self.owner.check(c, record.topic, record.partition)
            update_stats(c, record)
            save_dedup(c, record.topic, record.partition, dedup)
            c.executemany(
                "INSERT INTO txn_set_aside (txn_id, topic, partition, segment_id, entries) "
                "VALUES (?,?,?,?,?) ON CONFLICT (txn_id, topic, partition, segment_id) "
                "DO UPDATE SET entries=excluded.entries",
                [(txn, record.topic, record.partition, record.segment_id, json.dumps(entries))
                 for txn, entries in (set_aside or {}).items() if entries])

    def delete_segment(self, segment_id: int) -> None:
        with self.atomic() as c:
            self._held(c, segment_id)
            c.execute("DELETE FROM segments WHERE segment_id=?", (segment_id,))

    def _held(self, c: Tx, segment_id: int) -> None:
        """In ``c``, before a segment's row changes (offload, retention, an empty segment
        dropped): its partition is still this broker's, or NotOwnerError names the owner.
        A broker that lost a partition deletes nothing of it."""
        if self.owner is None:
            return
        row = c.execute("SELECT topic, partition FROM segments WHERE segment_id=?",
                        (segment_id,)).fetchone()
        if row is not None:
            self.owner.check(c, str(row[0]), int(row[1]))

    def segments(self, topic: str, partition: int | None = None) -> list[SegmentRecord]:
        """Segment records of ``topic`` sorted by (partition, segment_id)."""
        rows = self._by_topic(f"SELECT {SEGMENT_COLUMNS} FROM segments", topic, partition)
        return [segment_of_row(r) for r in rows]

    def _by_topic(self, select: str, topic: str, partition: int | None) -> list[Any]:
        """Rows of ``select`` for a topic (and partition), ordered by partition and segment."""
        sql = select + " WHERE topic=?"
        args: tuple[Any, ...] = (topic,)
        if partition is not None:
            sql += " AND partition=?"
            args += (partition,)
        return self.query(sql + " ORDER BY partition, segment_id", args)

    def segments_in_window(self, topic: str, partition: int, start_time: int | None,
                           end_time: int | None) -> list[SegmentRecord]:
        """:meth:`segments_in_windows` of one partition."""
        return self.segments_in_windows(topic, [partition], start_time, end_time)[partition]

    def segments_in_windows(self, topic: str, partitions: Sequence[int],
                            start_time: int | None, end_time: int | None
                            ) -> dict[int, list[SegmentRecord]]:
        """Per partition, the segments that may hold publish times in
        ``[start_time, end_time)``, in order, plus the open segment unless its first message is
        already past ``end_time``: one statement for all partitions, two index lookups and one
        range read per partition.

        Min/max publish times never decrease along a partition's segments, so the first segment
        whose max is ``>= start_time`` and the last whose min is ``< end_time`` bound the answer
        (a binary search, done by SQLite's B-tree indexes on those columns). The open segment's
        max still grows, so only its min can rule it out.
        """
        lo_sql = "0" if start_time is None else (
            "(SELECT segment_id FROM segments WHERE topic=:t AND partition=parts.p AND "
            "max_publish_time >= :t0 ORDER BY max_publish_time, segment_id LIMIT 1)")
        hi_sql = str(1 << 62) if end_time is None else (
            "(SELECT segment_id FROM segments WHERE topic=:t AND partition=parts.p AND "
            "min_publish_time < :t1 ORDER BY min_publish_time DESC, segment_id DESC LIMIT 1)")
        columns = ", ".join(f"s.{c}" for c in SEGMENT_FIELDS)
        # the bounds are index lookups, the range read walks only the window; the open
        # segment, if any, is the partition's last one. CROSS JOIN fixes the join order
        # (SQLite's planner otherwise may scan every segment of the topic: seconds, not ms)
        parts = [int(p) for p in partitions]
        given: Any
        if self.backend.dialect == "sqlite":
            source, join, given = "SELECT value FROM json_each(:parts)", "CROSS JOIN", \
                json.dumps(parts)
        else:  # PostgreSQL: an array; its planner needs no fixed join order
            source, join, given = "SELECT unnest(CAST(:parts AS bigint[]))", "JOIN", parts
        sql = (f"WITH parts(p) AS ({source}), "
               f"bounds(p, lo, hi) AS MATERIALIZED (SELECT p, {lo_sql}, {hi_sql} FROM parts) "
               f"SELECT {columns} FROM bounds {join} segments s ON s.topic=:t AND "
               "s.partition=bounds.p AND s.segment_id BETWEEN bounds.lo AND bounds.hi AND "
               f"s.state='CLOSED' UNION ALL SELECT {columns} FROM parts {join} segments s "
               "ON s.segment_id=(SELECT MAX(segment_id) FROM segments WHERE topic=:t AND "
               "partition=parts.p) WHERE s.state='OPEN' AND (CAST(:t1 AS bigint) IS NULL OR "
               "s.min_publish_time IS NULL OR s.min_publish_time < :t1)")
        args = {"t": topic, "parts": given, "t0": start_time, "t1": end_time}
        rows = self.query(sql, args)
        out: dict[int, list[SegmentRecord]] = {int(p): [] for p in partitions}
        for r in rows:  # closed segments, then each partition's open one (its last)
            out[r[1]].append(segment_of_row(r))
        for segs in out.values():  # in log order: a sort only if the engine did not keep it
            if any(a.segment_id > b.segment_id for a, b in itertools.pairwise(segs)):
                segs.sort(key=lambda seg: seg.segment_id)
        return out

    def compactions(self, topic: str) -> dict[int, Any]:
        return compactions_of(self, topic)

    def first_segment_id(self, topic: str, partition: int) -> int | None:
        row = self._one(
                "SELECT MIN(segment_id) FROM segments WHERE topic=? AND partition=?",
                (topic, partition))
        return None if row is None else row[0]

    def get_segment(self, segment_id: int) -> SegmentRecord:
        row = self._one(
                f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE segment_id=?", (segment_id,)
            )
        if row is None:
            raise NotFoundError(f"segment {segment_id} does not exist")
        return segment_of_row(row)

    def partitions(self) -> set[tuple[str, int]]:
        """Every partition of the store: those a topic serves and those with a segment left
        open (recovery seals it), as a broker claims them."""
        found = {(s.topic, s.partition) for s in self.open_segments()}
        found.update((t.name, p) for t in self.list_topics() for p in range(t.serving))
        return found

    def open_segments(self) -> list[SegmentRecord]:
        rows = self.query(
                f"SELECT {SEGMENT_COLUMNS} FROM segments WHERE state=? "
                "ORDER BY topic, partition, segment_id",
                (SegmentState.OPEN,),
            )
        return [segment_of_row(r) for r in rows]

    # -- bookie endpoints ---------------------------------------------------------------------

    def schema_versions(self, topic: str) -> list[SchemaInfo]:
        """Every schema version of ``topic``, in order (NotFoundError for an unknown topic;
        metadata/schema_registry.py adds and checks versions)."""
        name = str(self.get_topic(TopicName.parse(topic)).name)
        return [SchemaInfo(t, v, SchemaType(ty), d, f, c) for t, v, ty, d, f, c in self.query(
            "SELECT topic, version, type, definition, fingerprint, created_at FROM schemas "
            "WHERE topic=? ORDER BY version", (name,))]

    def bookie_endpoints(self) -> dict[str, str]:
        """bookie id -> advertised address, for every bookie that has one."""
        return dict(self.query(
                "SELECT bookie_id, address FROM bookie_endpoints"))

    def set_retention(self, topic: str, retention_ms: object) -> None:
        retention_ms = check_retention(retention_ms)
        with self.atomic() as c:
            c.execute("UPDATE topics SET retention_ms=? WHERE name=?", (retention_ms, topic))

    # -- producer de-duplication ----------------------------------------------------------------

    def load_dedup(self, topic: str, partition: int) -> dict[str, tuple[int, Any]]:
        """Per producer: (last stored sequence id, its saved acks); see
        ``managed_ledger/dedup.py``."""
        rows = self.query(
                "SELECT producer, sequence_id, position FROM dedup WHERE topic=? AND partition=?",
                (topic, partition),
            )
        return {r[0]: (r[1], json.loads(r[2])) for r in rows}
