"""A broker's lease over time: renewed every :data:`RENEW_S`, lapsed when it cannot be,
taken up again when it can.

The lease is the broker's heartbeat row (``ownership.py``). With several brokers
(``--lease-timeout``), another broker takes a broker's partitions over once that heartbeat is
older than the lease by the metadata server's clock (at its own next renewal). So a broker
that cannot renew must stop serving its partitions *before* that, whatever its renewal is
doing meanwhile: a renewal does not always fail, it can hang — a network that silently drops
every packet to PostgreSQL, and only those (bookies and clients still reach the broker),
holds a statement until the session takes its server for gone (``postgres.DEAD_PEER_S``,
longer than a lease). Hence two threads: the one renewing (:meth:`Lease.keep`), and a watch
(``broker/cluster/lease_watch.py``) that calls :meth:`Lease.lapse_if_due` four times a period: the
lease lapses at its deadline, the start of the last renewal that went through plus the
lease, less a margin of a quarter lease (at most one period) for the others' look and this
broker's letting go.

A lapse is not an end. Unless the metadata store is away for every live broker (then nobody
can take a partition over, and the broker serves on: ``shared_outage``), each of
:attr:`Lease.on_lapsed` is told why (the broker lets every partition go, its clients sent to
the other brokers) and renewals go on. The first that goes through tells
:attr:`Lease.on_rejoined` (the broker serves again what the metadata still says is its own;
what others took meanwhile is theirs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tierstream.errors import UnavailableError
from tierstream.metadata.ownership import RENEW_S, PartitionOwners

__all__ = ["Lease"]

log = logging.getLogger(__name__)


class Lease:
    """The lease of ``owners``' broker; ``lease_s`` None: one broker alone, whose lease
    never lapses (it is renewed for the others to see it live)."""

    def __init__(self, owners: PartitionOwners, lease_s: float | None) -> None:
        self.owners, self.lease_s = owners, lease_s
        #: called with why when the lease lapsed (the broker lets its partitions go)
        self.on_lapsed: list[Callable[[str], None]] = []
        #: called on the lease thread by the first renewal that went through after a lapse
        self.on_rejoined: list[Callable[[], None]] = []
        #: asked once the lease is due for want of the metadata store
        #: (broker/cluster/membership.py):
        #: True when it is away for every live broker, so none can take a partition over;
        #: the broker then serves on (``owners.shared_outage``)
        self.everyone_away: Callable[[], bool] | None = None
        self.lapsed = False
        self._lock = threading.Lock()  # the watch's lapse against the renewal's

    def __repr__(self) -> str:
        return f"Lease({self.owners.broker_id!r}, {self.lease_s}s, lapsed={self.lapsed})"

    @property
    def deadline_s(self) -> float | None:
        """How long after the start of its last renewal the lease lapses (None: never)."""
        if self.lease_s is None:
            return None
        return self.lease_s - min(RENEW_S, self.lease_s / 4)

    def silence(self) -> float | None:
        """Seconds since the start of the last renewal that went through (None: never)."""
        since = self.owners.lease_from
        return None if since is None else time.monotonic() - since

    def keep(self, stopping: threading.Event) -> None:
        """Renew the lease every :data:`RENEW_S` until ``stopping`` is set (a broker's
        thread). A renewal that fails (the metadata server unreachable) is said once, and
        once more when one goes through again; the last view holds meanwhile."""
        failing = False
        while not stopping.wait(RENEW_S):
            self.lapse_if_due(store_away=failing)
            before = self.owners.lease_from
            try:
                self.owners.renew()
            except UnavailableError as exc:
                if not failing:
                    log.warning("%s cannot renew its lease: %s; retrying every %g s",
                                self.owners.broker_id, exc, RENEW_S)
                failing = True
                continue
            # a renewal that hung past the deadline came too late: the lease lapsed
            # meanwhile (unless the store was away for every broker: then this renewal's
            # view says what is still ours)
            if not self.owners.shared_outage:
                self.lapse_if_due(store_away=False, since=before)
            if self.lapsed:
                self.lapsed = False
                log.warning("%s renews its lease again: it serves what is still its own",
                            self.owners.broker_id)
                for listener in self.on_rejoined:
                    listener()
            elif failing or self.owners.shared_outage:
                log.warning("%s renews its lease again", self.owners.broker_id)
            failing = self.owners.shared_outage = False
            for renewed in self.owners.after_renewal:
                renewed()

    def lapse_if_due(self, *, store_away: bool = True, since: float | None = None) -> bool:
        """Lapse the lease if it is past its deadline (counted from ``since``, by default
        the start of the last renewal that went through) and the metadata store is not away
        for every live broker too (asked where ``store_away``: this broker cannot reach
        it); each of :attr:`on_lapsed` is told why. Whether it lapsed now."""
        deadline = self.deadline_s
        since = self.owners.lease_from if since is None else since
        if deadline is None or since is None:
            return False
        silent = time.monotonic() - since
        with self._lock:
            if self.lapsed or silent <= deadline or self.owners.shared_outage:
                return False
            if store_away and self.everyone_away is not None and self.everyone_away():
                self.owners.shared_outage = True
                return False
            self.lapsed = True
        why = (f"{self.owners.broker_id} could not renew its lease for {silent:.1f} s, "
               f"close to the lease timeout of {self.lease_s:g} s: other brokers may take "
               "its partitions over")
        for listener in self.on_lapsed:
            listener(why)
        return True
