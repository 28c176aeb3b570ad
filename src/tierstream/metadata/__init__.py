"""The metadata store (SQLite in WAL mode): topics, segment records, cursors, de-duplication
state, transactions and schemas.

``records.py`` holds the record types every side shares (what a planner on another host
gets from the broker too); ``store.py`` the SQLite store and its migrations;
``schema_registry.py`` and ``transaction_records.py`` the tables of those two features.
"""
