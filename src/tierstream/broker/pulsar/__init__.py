"""The broker's side of Pulsar's protocol: the listener and its connections, the produce and
consume paths and the admin REST subset, calling the broker's services (the store,
subscriptions, schemas, streams). What goes over the wire — frames, commands, message ids,
message metadata, topic names, error codes — is :mod:`tierstream.pulsar_protocol`, which
knows nothing of the broker.

May import: the store, ``admin_actions.py``, ``subscriptions/``, ``topics/``, ``stats/``;
never ``flight/`` (the other serving surface).
"""
