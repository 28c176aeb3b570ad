"""The Arrow Flight serving surface, for tierstream's own clients: the service and its admin
actions (``server.py``), produce streams (``produce_stream.py``) and consume streams
(``consume_streams.py``).

May import: the store, ``cluster/``, ``subscriptions/``, ``stats/``; never ``pulsar/``.
"""
