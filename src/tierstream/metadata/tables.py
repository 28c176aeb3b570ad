"""The metadata store's tables, and how an older store is brought to this version.

A store records its schema version in ``meta``; the broker (the one writer) creates missing
tables and migrates an older store step by step when it opens it; readers refuse a version
they do not know (``store.py``).
"""

from __future__ import annotations

import logging

from tierstream.errors import ConfigError
from tierstream.metadata.backend import Backend, Tx
from tierstream.model.topic_rules import check_retention

log = logging.getLogger(__name__)

__all__ = ["SCHEMA_VERSION", "create_and_migrate", "ddl"]

SCHEMA_VERSION = 19

DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS topics (
    name TEXT PRIMARY KEY,
    partitions INTEGER NOT NULL,
    retention_ms INTEGER,
    created_at INTEGER NOT NULL,
    deleting_at INTEGER,
    key_routing TEXT,
    announced INTEGER,
    announced_at INTEGER
);
CREATE TABLE IF NOT EXISTS segments (
    segment_id INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    state TEXT NOT NULL,
    entries INTEGER NOT NULL DEFAULT 0,
    messages INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    min_publish_time INTEGER,
    max_publish_time INTEGER,
    created_at INTEGER NOT NULL,
    sealed_at INTEGER,
    ensemble TEXT NOT NULL,
    tier_url TEXT,
    offloaded_at INTEGER,
    bookie_deleted_at INTEGER,
    offload_pending_url TEXT,
    tier_bytes INTEGER,
    skipped TEXT
);
CREATE INDEX IF NOT EXISTS segments_by_partition ON segments (topic, partition, segment_id);
CREATE INDEX IF NOT EXISTS segments_by_max_time
    ON segments (topic, partition, max_publish_time, segment_id);
CREATE INDEX IF NOT EXISTS segments_by_min_time
    ON segments (topic, partition, min_publish_time, segment_id);
CREATE TABLE IF NOT EXISTS transactions (
    txn_id TEXT PRIMARY KEY,
    sink_id TEXT,
    batch_id INTEGER,
    state TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    parts TEXT NOT NULL DEFAULT '[]',
    reason TEXT
);
CREATE INDEX IF NOT EXISTS transactions_by_batch ON transactions (sink_id, batch_id);
CREATE TABLE IF NOT EXISTS txn_set_aside (
    txn_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    segment_id INTEGER NOT NULL,
    entries TEXT NOT NULL,
    PRIMARY KEY (txn_id, topic, partition, segment_id)
);
CREATE INDEX IF NOT EXISTS txn_set_aside_by_segment ON txn_set_aside (segment_id);
CREATE TABLE IF NOT EXISTS sinks (
    sink_id TEXT PRIMARY KEY,
    last_batch INTEGER NOT NULL,
    committed_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS schemas (
    topic TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    definition TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (topic, version)
);
CREATE TABLE IF NOT EXISTS schema_policies (
    topic TEXT PRIMARY KEY,
    compatibility TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cursors (
    topic TEXT NOT NULL,
    subscription TEXT NOT NULL,
    partition INTEGER NOT NULL,
    state TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (topic, subscription, partition)
);
CREATE TABLE IF NOT EXISTS deleted_segments (
    segment_id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    entries INTEGER NOT NULL,
    messages INTEGER NOT NULL,
    min_publish_time INTEGER,
    max_publish_time INTEGER,
    deleted_at INTEGER NOT NULL,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS dedup (
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    producer TEXT NOT NULL,
    sequence_id INTEGER NOT NULL,
    position TEXT NOT NULL,
    PRIMARY KEY (topic, partition, producer)
);
CREATE TABLE IF NOT EXISTS scale_events (
    topic TEXT NOT NULL,
    seq INTEGER NOT NULL,
    old_partitions INTEGER NOT NULL,
    new_partitions INTEGER NOT NULL,
    first_segment_id INTEGER NOT NULL,
    at INTEGER NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (topic, seq)
);
CREATE TABLE IF NOT EXISTS bookie_endpoints (
    bookie_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    host TEXT,
    writable INTEGER NOT NULL DEFAULT 0,
    instance TEXT
);
CREATE TABLE IF NOT EXISTS under_replicated (
    segment_id INTEGER PRIMARY KEY,
    reason TEXT NOT NULL,
    since INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS brokers (
    broker_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    pulsar_url TEXT,
    epoch INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    heartbeat_at INTEGER,
    admin_url TEXT
);
CREATE TABLE IF NOT EXISTS compactions (
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    horizon_segment INTEGER NOT NULL,
    horizon_entry INTEGER NOT NULL,
    horizon_index INTEGER NOT NULL,
    url TEXT,
    previous_url TEXT,
    keys INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    compacted_at INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
);
CREATE TABLE IF NOT EXISTS compaction_policies (
    topic TEXT PRIMARY KEY,
    threshold_bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS partition_owners (
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    broker_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    claimed_at INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
);
"""


def ddl(dialect: str) -> list[str]:
    """The statements of :data:`DDL` as ``dialect`` (``sqlite``, ``postgresql``) writes them:
    PostgreSQL's INTEGER is 32 bits (times in ms are not), and it numbers rows by identity."""
    text = DDL
    if dialect == "postgresql":
        text = text.replace("INTEGER PRIMARY KEY AUTOINCREMENT",
                            "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
        text = text.replace("INTEGER", "BIGINT")
    return [stmt.strip() for stmt in text.split(";") if stmt.strip()]


#: PostgreSQL: the transaction-scoped advisory lock that creates and migrates the tables, so
#: processes starting together on a new database (three ``bookie serve`` and a broker) do it
#: one at a time: CREATE TABLE IF NOT EXISTS is not safe against a concurrent twin
SCHEMA_LOCK_KEY = 0x7469_6572_7363  # "tiersc"


def create_and_migrate(c: Tx, backend: Backend) -> None:
    """Create what is missing and migrate an older store to :data:`SCHEMA_VERSION` (inside
    the caller's transaction; on PostgreSQL under :data:`SCHEMA_LOCK_KEY`)."""
    if backend.dialect == "postgresql":
        c.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
    for stmt in ddl(backend.dialect):
        c.execute(stmt)
    c.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
              "ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),))
    _migrate(c, backend)


def _migrate(conn: Tx, backend: Backend) -> None:
    version = int(conn.execute(
        "SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
    if version == 1:  # v2: tiered storage
        conn.execute("ALTER TABLE segments ADD COLUMN offload_pending_url TEXT")
        conn.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
        version = 2
    if version == 2:  # v3: topic deletion
        columns = backend.columns("topics")
        if "deleting_at" not in columns:
            conn.execute("ALTER TABLE topics ADD COLUMN deleting_at INTEGER")
        conn.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
        version = 3
    if version == 3:  # v4: bookie endpoints (the table is created by the DDL above)
        conn.execute("UPDATE meta SET value='4' WHERE key='schema_version'")
        version = 4
    if version == 4:  # v5: transactions and sinks (tables created by the DDL above)
        conn.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
        version = 5
    if version == 5:  # v6: topic schemas (tables created by the DDL above)
        conn.execute("UPDATE meta SET value='6' WHERE key='schema_version'")
        version = 6
    if version == 6:  # v7: tier file sizes (unknown, NULL, for files offloaded before)
        columns = backend.columns("segments")
        if "tier_bytes" not in columns:
            conn.execute("ALTER TABLE segments ADD COLUMN tier_bytes INTEGER")
        conn.execute("UPDATE meta SET value='7' WHERE key='schema_version'")
        version = 7
    if version == 7:  # v8: individual acks; the cursor column holds the whole state (its
        # JSON is read in either form: broker/subscriptions/cursor_state.py)
        columns = backend.columns("cursors")
        if "intervals" in columns:
            conn.execute("ALTER TABLE cursors RENAME COLUMN intervals TO state")
        conn.execute("UPDATE meta SET value='8' WHERE key='schema_version'")
        version = 8
    if version == 8:  # v9: elastic topics (scale_events, created by the DDL above; a topic
        # without events has the partitions it was created with)
        conn.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
        version = 9
    if version == 9:  # v10: transactions write once: entries readers skip, and entries of
        # undecided transactions set aside in sealed segments (txn_set_aside, by the DDL)
        columns = backend.columns("segments")
        if "skipped" not in columns:
            conn.execute("ALTER TABLE segments ADD COLUMN skipped TEXT")
        conn.execute("UPDATE meta SET value='10' WHERE key='schema_version'")
        version = 10
    if version == 10:  # v11: bookies as network services: the host a bookie runs on (the
        # placement spreads a segment's copies over hosts) and whether it takes writes
        columns = backend.columns("bookie_endpoints")
        if "host" not in columns:
            conn.execute("ALTER TABLE bookie_endpoints ADD COLUMN host TEXT")
        if "writable" not in columns:
            conn.execute("ALTER TABLE bookie_endpoints ADD COLUMN writable INTEGER NOT NULL "
                         "DEFAULT 0")
        conn.execute("UPDATE meta SET value='11' WHERE key='schema_version'")
        version = 11
    if version == 11:  # v12: a network bookie's identity (the instance its disk's cookie
        # names) and the segments lacking a whole copy (under_replicated, by the DDL above),
        # kept here so that any broker resumes their repair
        if "instance" not in backend.columns("bookie_endpoints"):
            conn.execute("ALTER TABLE bookie_endpoints ADD COLUMN instance TEXT")
        conn.execute("UPDATE meta SET value='12' WHERE key='schema_version'")
        version = 12
    if version == 12:  # v13: who routes a topic's keys (NULL: tierstream's hash; 'client':
        # its Pulsar clients, set when one stores a key elsewhere: pulsar_protocol)
        if "key_routing" not in backend.columns("topics"):
            conn.execute("ALTER TABLE topics ADD COLUMN key_routing TEXT")
        conn.execute("UPDATE meta SET value='13' WHERE key='schema_version'")
        version = 13
    if version == 13:  # v14: a client-routed topic's growth under way (scale_events.py)
        for column in ("announced", "announced_at"):
            if column not in backend.columns("topics"):
                conn.execute(f"ALTER TABLE topics ADD COLUMN {column} INTEGER")
        conn.execute("UPDATE meta SET value='14' WHERE key='schema_version'")
        version = 14
    if version == 14:  # v15: which broker owns each partition, and where brokers are
        # reached (brokers, partition_owners: by the DDL above; ownership.py)
        conn.execute("UPDATE meta SET value='15' WHERE key='schema_version'")
        version = 15
    if version == 15:  # v16: a broker's lease, renewed by the metadata server's clock
        if "heartbeat_at" not in backend.columns("brokers"):
            conn.execute("ALTER TABLE brokers ADD COLUMN heartbeat_at INTEGER")
        conn.execute("UPDATE meta SET value='16' WHERE key='schema_version'")
        version = 16
    if version == 16:  # v17: where a broker serves Pulsar's admin REST (stats redirects)
        if "admin_url" not in backend.columns("brokers"):
            conn.execute("ALTER TABLE brokers ADD COLUMN admin_url TEXT")
        conn.execute("UPDATE meta SET value='17' WHERE key='schema_version'")
        version = 17
    if version == 17:  # v18: a retention that is not milliseconds, as versions before
        # topic_rules.py could store through the Python API ('30d', '7'), broke every topic
        # listing and the tier pass; SQLite only (a PostgreSQL column refused such text)
        if backend.dialect == "sqlite":
            _retention_as_ms(conn)
        conn.execute("UPDATE meta SET value='18' WHERE key='schema_version'")
        version = 18
    if version == 18:  # v19: compacted topics' snapshots and thresholds (compactions,
        # compaction_policies: by the DDL above)
        conn.execute("UPDATE meta SET value='19' WHERE key='schema_version'")


def _retention_as_ms(conn: Tx) -> None:
    """Each topic's retention that SQLite kept as text or a float: milliseconds where it
    reads as a duration with its unit, else none (keep everything: a value that cannot be
    read never deletes data), each said in the broker's log."""
    rows = conn.execute("SELECT name, retention_ms FROM topics WHERE typeof(retention_ms) "
                        "NOT IN ('integer', 'null')").fetchall()
    for name, stored in rows:
        try:
            ms = check_retention(stored)
        except ConfigError as exc:
            ms = None
            log.warning("topic %s: its stored retention %r cannot be read (%s): it now keeps "
                        "every message; set one with tierstream topic set --retention",
                        name, stored, exc)
        else:
            log.warning("topic %s: its stored retention %r is now %s ms", name, stored, ms)
        conn.execute("UPDATE topics SET retention_ms=? WHERE name=?", (ms, name))
