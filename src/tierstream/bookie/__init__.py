"""Bookies: storage nodes, one directory each, holding ledger files (one per segment).

``ledger.py`` is the file format (frames with a CRC over ids and payload, and the entry
index); ``storage.py`` a bookie's directory (group-committed appends, replicas, repair);
``server.py`` serves a bookie's sealed ledgers read-only over Arrow Flight to readers on
other hosts.
"""
