"""Brokers sharing one metadata store: who is a member (``membership.py``), its lease and what
happens when it lapses (``lease_watch.py``), which partitions it owns and how they move
(``owned_partitions.py``), and topics as the cluster sees them (``topics.py``). How to reach
the other brokers is ``broker/peers.py``, below this package (transactions use it too).

May import: the broker's settings and peers, ``topics/`` and ``transactions/`` (a move hands
their work over); never the store's owner (``broker/store.py`` builds the cluster) nor a
serving surface.
"""
