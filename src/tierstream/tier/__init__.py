"""Tiered storage: closed segments as Parquet files on an fsspec URL, registered in Iceberg.

``storage.py`` is the tier itself (paths, the key-bucket row layout, reads and deletes);
``catalog.py`` keeps each topic's Iceberg table. The broker moves segments here in idempotent
steps and applies retention (``broker/topics/offload.py``).
"""
