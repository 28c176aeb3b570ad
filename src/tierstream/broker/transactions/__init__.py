"""Transactions: the coordinator that commits or aborts them atomically (``coordinator.py``),
the parts staged on each partition (``parts.py``), which broker owns each transaction
(``owners.py``) and staging left by older versions (``old_staging.py``).

May import: ``broker/peers.py`` (an owner elsewhere) and the layers below the broker; never
a serving surface.
"""
