"""A cluster broker's watch on its own lease (``metadata/lease.py``): served on through an
outage of the metadata store that every broker shares, let go when only this broker is cut
off, taken up again when it reaches the store.

Four times a renewal period the watch asks whether the lease is past its deadline — the
renewal thread may be hanging in a statement sent into a network that drops it. If it is,
the other live brokers are asked (Flight) whether they reach the metadata store: when none
does, nobody can take a partition over and this broker serves on; when one does (or does not
answer), this broker may be the one cut off, and it lets every partition go before another
takes it: appends and dispatch are refused with a retryable "not the owner" error naming
another live broker (Flight and Pulsar clients go there, and are served once it took the
partition over), and the log says so in one line. Its renewals go on; the first that goes
through rejoins the cluster: the broker says where it is reached again (its row is gone if it
owned nothing any more) and serves what the metadata still says is its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierstream.broker.peers import Peers
from tierstream.errors import TierstreamError
from tierstream.metadata.lease import Lease
from tierstream.metadata.ownership import MISSED_S, RENEW_S, Owner, PartitionOwners
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from collections.abc import Set

__all__ = ["LeaseWatch"]

log = logging.getLogger(__name__)


class LeaseWatch:
    """The lease of ``owners``' broker watched through outages; ``serves()`` says which
    partitions it serves, ``rejoin()`` serves again what is still its own."""

    def __init__(self, owners: PartitionOwners, lease: Lease, peers: Peers, *,
                 serves: Callable[[], Set[tuple[str, int]]], rejoin: Callable[[], None],
                 thread_failed: Callable[[str], Callable[[BaseException], None]]) -> None:
        self.owners, self.lease, self.peers = owners, lease, peers
        self._serves, self._rejoin = serves, rejoin
        #: the other brokers whose lease was live at the last look: {id: (url, pulsar url)}
        self.live: dict[str, tuple[str, str | None]] = {}
        lease.everyone_away = self.everyone_away
        lease.on_lapsed.append(self.let_go)
        lease.on_rejoined.append(self.rejoined)
        self._worker = Worker("broker-lease-watch", self._watch,
                              on_error=thread_failed("the broker's lease watch"))

    @property
    def live_urls(self) -> dict[str, str]:
        """The other live brokers' Flight URLs, by id."""
        return {b: url for b, (url, _) in self.live.items()}

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        self._worker.stop()

    def _watch(self) -> None:
        """Never a metadata read here: the store may be what is away."""
        stopping = self._worker.stopping
        while not stopping.wait(RENEW_S / 4):
            self.lease.lapse_if_due(store_away=True)

    def look(self) -> None:
        """Note the other brokers whose lease is live now, and where they are reached."""
        lease_ms = None if self.lease.lease_s is None else self.lease.lease_s * 1000
        with contextlib.suppress(TierstreamError):  # the metadata away: the last look holds
            live = {str(b["broker"]): (str(b["url"]), b["pulsar_url"])
                    for b in self.owners.brokers()
                    if not b["this"] and b["url"] and b["heard_ms_ago"] is not None
                    and (lease_ms is None or b["heard_ms_ago"] <= lease_ms)}
            if live != self.live:
                log.info("%s sees %d other live broker(s)%s", self.owners.broker_id, len(live),
                         "".join(f"; {b} at {u}" for b, (u, _) in sorted(live.items())))
            self.live = live

    def everyone_away(self) -> bool:
        """Whether every other broker live at the last look answers that it has missed a
        renewal too (silent past two periods): the metadata store is away for them all, so
        none can take a partition over (one silent that long waits a lease after its outage
        before it takes any: ``Cluster._may_take_over``). One that does not answer, or
        renewed, says no (this broker may be the one cut off). A broker alone says no."""
        if not self.live or self.lease.lease_s is None:
            return False
        answers = self.peers.call_each({url: ("ping", {}) for url, _ in self.live.values()})
        for answer in answers.values():
            if isinstance(answer, Exception) or not isinstance(answer, dict):
                return False
            silent = answer.get("lease_silent_s")
            if silent is None or float(silent) <= MISSED_S:
                return False
        if not self.owners.shared_outage:
            log.warning("%s could not renew its lease for %.1f s, and no other broker reaches "
                        "the metadata store either: none can take its partitions over, so it "
                        "serves on", self.owners.broker_id, self.lease.silence() or 0.0)
        return True

    def let_go(self, why: str) -> None:
        """The lease lapsed: every partition served here is let go, its clients sent to
        another live broker (which serves it once it took it over)."""
        served = sorted(self._serves())
        # the live brokers at the last look, else those the lease's view has owning some
        # partition (the look needs the metadata store, which may have been away since)
        peers = sorted(self.live.items()) or sorted(
            (o.broker_id, (o.url, o.pulsar_url)) for o in self.owners.others() if o.url)
        given = {}
        for i, key in enumerate(served):
            if peers:
                broker, (url, pulsar_url) = peers[i % len(peers)]
                given[key] = Owner(broker, 0, now_ms(), url, pulsar_url)
            else:
                given[key] = Owner("another broker, once it took it over", 0, now_ms())
        log.error("%s; it stops serving its %d partition(s) until it renews its lease again, "
                  "and sends their clients to %s", why, len(served),
                  ", ".join(b for b, _ in peers) or "the broker that takes them over")
        # its renewal waits for the store: so would every read; until a statement goes
        # through, what was read last answers (topics, schemas), as in any outage of it
        self.owners.metadata.backend.unreachable.set()
        self.owners.note(given=given)

    def rejoined(self) -> None:
        """The first renewal after a lapse went through: say where this broker is reached
        again, then serve what is still its own."""
        if self.owners.advertised is not None:
            with contextlib.suppress(TierstreamError):  # the next lapse or renewal says it
                self.owners.advertise(*self.owners.advertised)
        self._rejoin()
