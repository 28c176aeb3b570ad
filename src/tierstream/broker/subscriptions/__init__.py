"""The broker's subscriptions, as Pulsar's: the registry of dispatchers (``registry.py``), one
dispatcher per (topic, subscription, partition) (``dispatcher.py``) with its consumers
(``attached.py``), their selectors and key holds (``selectors.py``, ``key_holds.py``), its
cursor and how it is stored (``cursor_state.py``, ``cursor_writer.py``), dead letters
(``dead_letters.py``), acks in doubt after a restart (``ack_doubt.py``) and the window of
entries read ahead (``read_window.py``).

May import: the store and the layers below the broker; never a serving surface.

Import the modules themselves: this package's ``__init__`` stays empty, so that importing
one part does not load the others.
"""
