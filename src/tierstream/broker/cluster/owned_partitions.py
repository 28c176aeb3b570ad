"""What a broker does as partitions are taken from it, and for partitions it does not
serve: the owner's side of ``metadata/ownership.py``, mixed into the store."""

from __future__ import annotations

import logging
import threading

from tierstream.broker.cluster.membership import Cluster
from tierstream.errors import NotOwnerError, UnavailableError
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.metadata.ownership import Owner, PartitionOwners

__all__ = ["OwnedPartitions"]

log = logging.getLogger(__name__)


class OwnedPartitions:
    """The store's partitions as this broker owns, loses and refuses them."""

    owners: PartitionOwners
    cluster: Cluster | None
    _logs: dict[tuple[str, int], PartitionLog]
    fenced: threading.Event
    fenced_reason: str

    def _on_fenced(self, topic: str, partition: int, reason: str) -> None:
        """A bookie refused this broker's write to a partition as fenced, or the metadata
        its seal. When another broker owns the partition now (it took the partition over:
        it fences the open ledger and recovers it), that partition alone is let go, and
        the lease's next renewal lets its consumers go; otherwise a newer broker took the
        whole store over, and this one stops writing."""
        try:
            owner = self.owners.owner_of(topic, partition)
        except UnavailableError:
            owner = None  # the metadata cannot tell: the store-wide answer
        if owner is not None and owner.broker_id != self.owners.broker_id:
            plog = self._logs.get((topic, partition))
            if plog is not None and not plog.lost:
                log.info("%s partition %d was taken over by %s: %s", topic, partition,
                         owner.describe(), reason)
                self._lose({(topic, partition): owner})
            return
        self.fence(reason)

    def fence(self, reason: str) -> None:
        """This broker no longer serves the store (a newer one took it over; several
        brokers: its lease expired), and stops, saying ``reason``."""
        if not self.fenced.is_set():
            self.fenced_reason = reason
            self.fenced.set()
            log.error("%s: this broker stops writing", reason)

    def _lose(self, lost: dict[tuple[str, int], Owner]) -> None:
        """Partitions the lease's renewal found owned by other brokers: they are served here
        no more (appends refused, following reads ended, nothing sealed: the owner does)."""
        let_go = []
        for (topic, partition), owner in sorted(lost.items()):
            plog = self._logs.get((topic, partition))
            if plog is not None and not plog.lost:
                plog.lose(self.owners.refusal(topic, partition, owner))
                let_go.append(f"{topic} partition {partition} to {owner.broker_id}")
        if let_go:
            log.warning("%s lost %d partition(s) to other brokers (%s): it stops serving them",
                        self.owners.broker_id, len(let_go), ", ".join(let_go[:5]))

    def serves(self) -> set[tuple[str, int]]:
        """The partitions served here (not lost to another broker)."""
        return {k for k, plog in list(self._logs.items()) if not plog.lost}

    def owner_elsewhere(self, topic: str, partition: int) -> Owner | None:
        """Another broker owning the partition (a Pulsar LOOKUP is sent there), None when it
        is this one's or nobody's yet. A partition served here is answered from the lease's
        view; any other is asked of the metadata, since it may have moved since the last
        renewal (an unload or a drain hands partitions over, and sends their clients here,
        before this broker's next renewal: the view would send them straight back). While
        the metadata is away, the view answers."""
        owner = self.owners.elsewhere(topic, partition)
        if owner is None and (topic, partition) in self._logs:
            return None
        if not self.owners.renewing():
            return owner
        try:
            found = self.owners.owner_of(topic, partition)
        except UnavailableError:
            return owner
        if found is None or found.broker_id == self.owners.broker_id:
            return None
        return found

    def open_here(self, topic: str, partition: int) -> None:
        """Before a client's stream of the partition opens here: refused, naming the owner,
        when another broker owns it by the lease's view — and by the metadata, where that
        view names another broker (``Cluster.serve_if_placed``: it may have been handed
        here since the last renewal, and is opened now)."""
        try:
            self.owners.serving(topic, partition)
        except NotOwnerError:
            if self.cluster is None or not self.cluster.serve_if_placed(topic, partition):
                raise

    def not_served(self, topic: str, partition: int) -> NotOwnerError | UnavailableError:
        """The error for a stream or call of a partition of ``topic`` that this broker does
        not serve: its owner's address, by the lease's last renewal, for its clients to go
        there; or, while no other broker serves it (placed here and opened at the next
        renewal, or taken over from a broker whose lease expired), unavailable for now."""
        owner = self.owner_elsewhere(topic, partition)
        if owner is not None:
            return self.owners.refusal(topic, partition, owner)
        return UnavailableError(f"{topic} partition {partition} is not served by "
                                f"{self.owners.broker_id}, nor by another broker yet (a broker "
                                "is opening it, or taking it over from one whose lease "
                                "expired): try again shortly")
