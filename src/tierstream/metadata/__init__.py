"""The metadata store: topics, segment records, cursors, de-duplication state, transactions,
schemas, scale events and the bookies' registry — on one of two backends.

- ``backend.py``: what a backend is (a transaction, a read), and the SQLite one (a file in the
  data directory, WAL mode; the default);
- ``postgres.py``: the PostgreSQL one (``--metadata postgresql://...``), which waits out the
  server's outages; ``leader_lease.py``: a broker's hold on that database (its advisory lock,
  heartbeat and a standby's takeover);
- ``tables.py``: the tables and their migrations, written once for both engines;
- ``store.py``: :class:`~tierstream.metadata.store.MetadataStore`, the queries over either
  (``segment_rows.py``: the segment rows it and ``scale_events.py`` write);
  ``ownership.py``: which broker owns each partition, checked at every new segment and seal;
  ``records.py`` the record types every side shares (what a planner on another host gets from
  the broker too); ``schema_registry.py``, ``transaction_records.py``, ``scale_events.py``,
  ``bookie_registry.py`` and ``replication.py`` the tables of those features.
"""
