"""A consumer attached to one subscription's partition, and who may join whom."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.errors import ConflictError
from tierstream.model.positions import KeyRange
from tierstream.model.subscription_type import SubscriptionType

__all__ = ["Attached", "ConsumerSettings", "check_join", "ranges_of"]


@dataclass(frozen=True)
class ConsumerSettings:
    name: str
    type: str
    sticky: tuple[KeyRange, ...] | None  # key_shared ranges given by the user
    permits: int                          # receiver queue for this partition
    ack_timeout_s: float | None = None
    max_redeliveries: int | None = None
    dead_letter_topic: str | None = None
    initial_permits: int | None = None    # None: ``permits`` (a Pulsar client sends FLOW first)
    #: hand out an entry whole while any permit is left, as Pulsar's dispatchers do (a
    #: Pulsar consumer gets it as one batch whose ids are its receipts')
    whole_entries: bool = False
    #: its client says it is there this often (None: it does not; a Pulsar client's
    #: connection is pinged instead): silent for twice as long, it is let go (redelivery.py)
    keepalive_s: float | None = None
    #: the client object's id: an attach with the same one comes from a client that lost
    #: this consumer's stream (a connection gone without a word) and replaces it
    instance: str | None = None


class Attached:
    """A consumer connected to one partition; the broker streams :attr:`outbox` to it."""

    def __init__(self, idx: int, settings: ConsumerSettings, gone: Callable[[], bool]) -> None:
        self.idx = idx
        self.settings = settings
        self.name = settings.name
        self.gone = gone
        self.permits = settings.permits if settings.initial_permits is None \
            else settings.initial_permits
        self.held = 0          # messages delivered (or nacked) and not acknowledged
        self.delivered = 0
        self.redelivered = 0   # of those, sent again
        self.acked = 0
        self.outbox: queue.SimpleQueue[pa.RecordBatch | None] = queue.SimpleQueue()
        self.detached = False
        self.heard = time.monotonic()  # its last keepalive (or its attach)
        #: failover: whether the dispatcher serves this consumer now (None: not failover);
        #: set by the dispatcher as consumers come and go, read by the Pulsar listener
        self.active: bool | None = None

    def stats(self, partition: int, assignment: str) -> dict[str, Any]:
        return {"name": self.name, "partition": partition, "assignment": assignment,
                "unacked": self.held, "delivered": self.delivered,
                "redelivered": self.redelivered, "permits": self.permits}

    def silent(self, now: float) -> bool:
        """Whether its client, which keeps it alive, was not heard from for two keepalives."""
        keepalive = self.settings.keepalive_s
        return keepalive is not None and now - self.heard > 2 * keepalive

    def lost_to(self, settings: ConsumerSettings) -> bool:
        """Whether ``settings`` come from this consumer's own client, attaching again."""
        return settings.instance is not None and settings.instance == self.settings.instance

    def next_batch(self, timeout: float) -> pa.RecordBatch | None:
        """The next batch to stream, or None (none within ``timeout``, or detached)."""
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None


def check_join(subscription: str, topic: str, partition: int, kind: str | None,
               consumers: Iterable[Attached], s: ConsumerSettings) -> None:
    """ConflictError, naming both sides, if consumer ``s`` cannot join subscription
    ``subscription`` (of type ``kind``, None before its first consumer) beside ``consumers``."""
    where = f"subscription {subscription!r} on {topic!r}"
    if kind is not None and s.type != kind:
        raise ConflictError(
            f"{where} is {kind}; a {s.type} consumer cannot join it (a subscription "
            "keeps the type it was created with: delete it, or use another name)")
    for other in consumers:
        if other.name == s.name:
            raise ConflictError(f"{where} already has a consumer named {s.name!r} "
                                "connected")
        if s.type == SubscriptionType.EXCLUSIVE:
            raise ConflictError(f"{where} partition {partition} already has an "
                                f"exclusive consumer ({other.name})")
        if s.type == SubscriptionType.KEY_SHARED:
            theirs = other.settings.sticky
            if (theirs is None) != (s.sticky is None):
                given = "with" if s.sticky is not None else "without"
                how = "by consistent hashing" if theirs is None else "by sticky key ranges"
                raise ConflictError(f"{where} splits keys {how}; a consumer {given} "
                                    "key_ranges cannot join it")
            if s.sticky and theirs and any(a.lo < b.hi and b.lo < a.hi
                                           for a in s.sticky for b in theirs):
                raise ConflictError(
                    f"key ranges {[str(r) for r in s.sticky]} overlap those of consumer "
                    f"{other.name} on {where}")


def ranges_of(mask: np.ndarray) -> str:
    """``mask`` over the hash slots as ``lo:hi`` ranges (``-`` if none)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    pairs = edges.reshape(-1, 2)
    if not len(pairs):
        return "-"
    text = ", ".join(f"{a}:{b}" for a, b in pairs[:4].tolist())
    return text + (f" (+{len(pairs) - 4} more)" if len(pairs) > 4 else "")
