"""Who puts a topic's keys in its partitions: tierstream's hash, or the topic's Pulsar clients.

tierstream's writers route a key by ``key_hash % partitions``; Pulsar's clients route by their
own hash (BoostHash in the C++-core clients, JavaStringHash in Java and Go, or a custom
router), which the broker cannot compute. At a fixed partition count either keeps each key in
one partition, and so its order for every reader (key ranges split the hash space, whatever
partition a key is in). Across a scale event a client routes by the old count until it looks
again (every 60 s), and only under tierstream's routing can the broker tell a key sent where
it still belongs from one that moved (and refuse the latter). So the first time a Pulsar
producer stores a key where tierstream's hash would not, the topic is recorded as
``client``-routed — unless it grew before, where the key is refused as before — and from then
on it grows in two steps, announced before it is read (``broker/topics/growth.py``).
"""

from __future__ import annotations

import logging
import threading

from tierstream.metadata.records import TopicRecord
from tierstream.metadata.scale_events import CLIENT_ROUTING, route_keys_by_client
from tierstream.metadata.store import MetadataStore

__all__ = ["KeyRouting"]

log = logging.getLogger(__name__)


class KeyRouting:
    """The topics whose keys their clients route, known from their records and kept in
    memory (the produce path asks per send); changed under the store's topics lock, which a
    growth holds too, so a topic never grows while it turns client-routed."""

    def __init__(self, metadata: MetadataStore, topics_lock: threading.Lock) -> None:
        self._metadata = metadata
        self._lock = topics_lock
        self._client: set[str] = set()

    def opened(self, record: TopicRecord) -> None:
        if record.key_routing == CLIENT_ROUTING:
            self._client.add(record.name)

    def forget(self, topic: str) -> None:
        self._client.discard(topic)

    def by_client(self, topic: str) -> bool:
        return topic in self._client

    def accept_client_routing(self, topic: str) -> bool:
        """Record ``topic`` as client-routed (True), or False if it grew before."""
        if topic in self._client:
            return True
        with self._lock:
            if topic not in self._client:
                if not route_keys_by_client(self._metadata, topic):
                    return False
                self._client.add(topic)
                log.info("%s: a Pulsar producer stored a key where tierstream's hash would "
                         "not; its keys are routed by its clients from now on (it grows in "
                         "two steps: broker/topics/growth.py)", topic)
        return True
