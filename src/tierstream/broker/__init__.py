"""The broker: the one process that serves the embedded store over Arrow Flight.

``server.py`` is the Flight service (produce, consume, admin actions); ``store.py`` owns every
partition's managed ledger, the bookies and the tier for one data directory; ``config.py``
its settings; ``housekeeping.py`` its periodic work (rollover by age, re-replication,
growth, expired transactions, the tier pass); ``recovery.py`` what happens at start after a
crash; ``subscriptions.py`` the
durable cursors and who is attached; ``transaction_coordinator.py`` staged writes and their
atomic commits; ``process.py`` runs a broker as a child process (tests, tools).
"""
