"""What the broker reports: topic and broker stats (``topic_stats.py``) and Prometheus
metrics (``metrics.py``).

May import: the store, ``cluster/``, ``topics/``, ``subscriptions/``; never a serving surface
(the surfaces call it).
"""
