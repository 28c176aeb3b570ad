"""The broker's side of bookies — BookKeeper's client, a library of the broker, not part of
the bookie: the one interface every bookie is written through (``client.py``), a bookie
directory of this process (``local.py``) and a bookie endpoint on another host
(``remote.py``) behind it; where a segment's copies go and how many must answer
(``placement.py``); and re-replication of copies a bookie lost (``repair.py``).

The bookie server itself (its storage, ledger files, write handler and Flight endpoint) is
``tierstream.bookie``; the two share only the ledger format and the wire (``bookie/wire.py``).
"""
