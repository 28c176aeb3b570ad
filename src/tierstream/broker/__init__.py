"""The broker: the process that serves the embedded store, to tierstream's clients over Arrow
Flight and to Pulsar's over its binary protocol.

At this root: ``store.py`` owns every partition's managed ledger, the bookies and the tier
of one data directory; ``config.py`` its settings; ``run.py`` starts a broker with its
listeners; ``process.py`` runs one as a child process (tests, tools); ``data_dir.py`` the
directory's lock; ``peers.py`` how to reach the other brokers of a cluster;
``admin_actions.py`` the admin operations both serving surfaces run. The rest is grouped by
concern, one subpackage each:

- ``cluster/``: brokers of one metadata store — membership, leases, ownership, moves;
- ``topics/``: a topic's life — growth and auto scale, deletion, offload, housekeeping,
  recovery at start, key routing, producer access modes;
- ``transactions/``: the coordinator, staged parts and who owns each;
- ``subscriptions/``: durable cursors, dispatchers and their consumers;
- ``stats/``: topic and broker stats, Prometheus metrics;
- ``flight/`` and ``pulsar/``: the two serving surfaces.

Layers (``tests/test_layers.py``): the serving surfaces import the concerns below them and
never each other; nothing below imports a serving surface; ``stats/`` reads the concerns and
is read by the surfaces.
"""
