"""The bookie server: a storage node holding ledger files (one per segment), in a directory of
its own, on this host or another.

``ledger.py`` is the file format (frames with a CRC over ids and payload, the entry index);
``storage.py`` a bookie's directory (group-committed appends, fencing, recovery reads);
``writes.py`` the write handler a broker on another host appends through, ``wire.py`` what
they say to each other; ``server.py`` the Flight endpoint (``tierstream bookie serve``) that
serves both, and sealed ledgers to readers; ``cookie.py`` a disk's identity.

The broker's side — the client it writes bookies through, placement, quorums and
re-replication — is ``tierstream.managed_ledger.bookies``.
"""
