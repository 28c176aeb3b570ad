"""A topic's life on this broker: growth (``growth.py``) and auto scale, deletion, offload to
the tier, the periodic housekeeping that drives them, recovery of partitions at start, who
routes its keys, and producer access modes (exclusive, wait-for-exclusive).

May import: ``transactions/`` (housekeeping ends expired ones) and the layers below the
broker; never a serving surface.
"""
