"""Pulsar's binary protocol, spoken by the broker so that Pulsar clients (Java, Go, C++,
Python, Node) can connect, look topics up and produce to tierstream (``server.py``)."""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["key_router"]

_unkeyed = itertools.count()


def key_router(message: Any, num_partitions: int) -> int:
    """A Pulsar Python client's ``message_router`` that sends each key where tierstream's
    key routing puts it (``key_hash(key) % partitions``), so that a key's messages stay in one
    partition whoever writes them; messages without a key go round robin::

        client.create_producer(topic, message_router=tierstream.pulsar_protocol.key_router)
    """
    from tierstream.model.message_format import key_hash

    key = message.partition_key()
    if not key:
        return next(_unkeyed) % num_partitions
    return key_hash(key) % num_partitions
