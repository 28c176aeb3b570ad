"""tierstream's own wire, on Arrow Flight: errors and messages as both sides send them
(``flight.py``) and who may call (``security.py``: tokens, TLS). Pulsar's wire is
``tierstream.pulsar_protocol``.
"""
