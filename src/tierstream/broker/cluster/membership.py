"""Several brokers serving one store at once (``broker start --cluster``).

Each partition is owned by one broker through a lease (``metadata/ownership.py``): the owner
renews its ``brokers.heartbeat_at`` every second, by the metadata server's clock. A broker of
a cluster owns what it claimed when it started, what it opened (a new topic's partitions),
and what it took over:

- **Takeover.** After each renewal, a broker looks for *orphans*: partitions no live broker
  owns (nobody, or an owner whose lease is older than ``--lease-timeout``). It takes its fair
  share of them (the live brokers end up owning about as many each), at a **new writer
  epoch** above every earlier claim, with a compare-and-set per partition, so two brokers
  taking over at once never both get one. Then, for those partitions alone, BookKeeper's
  recovery: each open ledger is fenced at the new epoch on its bookies (the former owner's
  appends are refused from then on), sealed at the longest prefix an ack quorum could hold
  and re-replicated; a new segment is opened, and its clients, told by the former owner's
  silence or by a refusal that names the new owner, reconnect.
- **Expiry.** A broker that could not renew its lease for ``--lease-timeout`` (paused, cut
  off from the metadata server) stops: other brokers may own its partitions now. Its writes
  were refused from the moment they did (fenced ledgers; every new segment and seal checks
  the owner in its own transaction), so stopping is for its clients, which go elsewhere.
- **The metadata store away for everyone.** A lease past due because PostgreSQL does not
  answer is not over when every other live broker (as last seen) answers that it cannot
  renew either: nobody can take a partition over without the store, so the broker serves on
  (its appends need only the bookies) until the store's outage limit. Once it is back, a
  broker takes nothing over for a lease (every lease looks expired then; the others renew
  meanwhile), and its own late renewal says which partitions are still its own.

A move takes the lease timeout (the former owner's silence) plus at most one renewal period
plus the recovery of the partitions moved. A transaction's entries are staged by each
partition's owner, and its commit is shown by each owner (``txn_owners.py``). What takes a
topic as a whole — its growth, auto-scaling — gathers its partitions on one broker first
(``cluster_topics.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tierstream.broker.cluster.lease_watch import LeaseWatch
from tierstream.broker.cluster.topics import ClusterTopics
from tierstream.broker.config import StoreConfig
from tierstream.broker.peers import Peers
from tierstream.broker.topics.growth import Growth
from tierstream.broker.topics.recovery import RecoveryReport, recover_open_segments
from tierstream.broker.transactions.owners import TxnOwners
from tierstream.errors import ConfigError, ConflictError, TierstreamError, UnavailableError
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.metadata.bookie_registry import take_writer_epoch
from tierstream.metadata.leader_lease import BROKER_APPLICATION
from tierstream.metadata.lease import Lease
from tierstream.metadata.ownership import MISSED_S, RENEW_S, Owner, PartitionOwners
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.store import MetadataStore
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

__all__ = ["Cluster", "ClusterStore", "cluster_of", "refuse_beside_a_cluster"]

log = logging.getLogger(__name__)

_NEVER = object()  # no look for orphans yet


class ClusterStore(Protocol):
    """What a cluster broker's takeovers need of its store (``broker/store.py``)."""

    config: StoreConfig
    metadata: MetadataStore
    bookies: dict[str, BookieClient]
    owners: PartitionOwners
    lease: Lease
    epoch: int
    ack_quorum: int
    topics_lock: threading.Lock
    closing: threading.Event
    fenced: threading.Event
    growth: Growth

    def choose_ensemble(self) -> tuple[str, ...]: ...

    def serves(self) -> set[tuple[str, int]]: ...

    def partition(self, topic: str, partition: int) -> PartitionLog: ...

    @property
    def cluster(self) -> Cluster | None: ...

    def open_partitions(self, topic: TopicRecord, opened: list[SegmentRecord]) -> None: ...

    def thread_failed(self, what: str) -> Callable[[BaseException], None]: ...


class Cluster:
    """The partitions ``store``'s broker serves as one of several, with leases of
    ``lease_s``."""

    def __init__(self, store: ClusterStore, lease_s: float) -> None:
        self.store, self.lease_s = store, lease_s
        self.lease_ms = int(lease_s * 1000)
        self.taken_over = 0  # partitions taken over from brokers whose lease expired
        #: the other brokers, asked with this one's token, trusted by the store's CA (its
        #: bookies'): what their partitions' stats are (topic_stats.py)
        self.peers = Peers(auth_token=store.config.bookie_token,
                           tls_ca=store.config.bookie_tls_ca)
        #: the owners of a transaction's partitions that other brokers serve
        self.txn_owners = TxnOwners(store, self.peers, lambda: self.watch.live_urls)
        #: a topic spread over the brokers, as a whole: grown, and judged for auto-scaling
        self.topics = ClusterTopics(store, self.peers, self.serve)
        #: its lease through outages, and the other live brokers it knows (lease_watch.py)
        self.watch = LeaseWatch(store.owners, store.lease, self.peers, serves=store.serves,
                                rejoin=self._rejoin, thread_failed=store.thread_failed)
        self._wake = threading.Event()
        self._worker: Worker | None = None
        self._version: str | None = None  # the owners' version the placements were read at
        self._serving = threading.Lock()  # one serve() at a time
        #: the owners' version at the last look for orphans (each renewal's otherwise reads
        #: every partition; a look is due when it moved or a lease expired)
        self._looked: object = _NEVER

    def __repr__(self) -> str:
        return f"Cluster(broker={self.store.owners.broker_id!r}, lease={self.lease_s:g}s)"

    def join(self) -> set[tuple[str, int]]:
        """At the broker's start: its lease first, then its share of the orphans. A store
        served by a broker without ``--cluster`` (it holds the store alone) is refused."""
        from tierstream.metadata.leader_lease import LOCK_KEY

        metadata = self.store.metadata
        if metadata.query("SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                          "objid = ? AND granted", (LOCK_KEY & 0xFFFF_FFFF,))[0][0]:
            raise ConflictError(f"the metadata store {metadata.backend.name} is served by a "
                                "broker started without --cluster, which serves it alone: "
                                "stop it, and start every broker of the store with --cluster")
        self.store.owners.join()
        metadata.backend.name_sessions(_session_name(self.store.owners.broker_id))  # _end_sessions
        metadata.owner = self.store.owners  # every new segment and seal checks the owner
        self.watch.look()  # known from the start: asked in an outage of the store
        return set(self.claim())

    def claim(self) -> list[tuple[str, int]]:
        """Claim this broker's share of the orphans, at a new writer epoch (the bookie
        clients fence and recover under it). Returns the partitions claimed."""
        owners = self.store.owners
        version = owners.version
        if not self._may_take_over():
            return []
        if version == self._looked and not owners.expired(self.lease_ms):
            return []  # no lease expired, and nothing released or placed since the last look
        orphans, room = owners.orphans(self.store.metadata.partitions(), self.lease_ms)
        self._looked = version
        if not orphans or not room or not self._may_take_over():  # (the reads may have
            return []  # waited out an outage of the metadata store: asked again)
        self._end_sessions(owners.expired(self.lease_ms))
        self._write_under(take_writer_epoch(self.store.metadata))
        return owners.take_over(orphans[:room], self.store.epoch, self.lease_ms)

    def _end_sessions(self, brokers: list[str]) -> None:
        """End the metadata sessions of ``brokers``, whose lease expired: one paused inside
        a transaction holds its row locks for as long as its session lives, and the seal of
        each segment it was writing would wait for them (the zombie's next statement opens
        a new session, and finds its lease lost). Best effort: said when it fails."""
        if not brokers:
            return
        try:
            ended = self.store.metadata.query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                "current_database() AND application_name = ANY(?)",
                ([_session_name(b) for b in brokers],))
        except Exception as exc:  # not allowed to (another role), or the server away
            log.warning("could not end the metadata sessions of %s, whose lease expired: %s",
                        ", ".join(brokers), exc)
            return
        if ended:
            log.info("ended %d metadata session(s) of %s, whose lease expired", len(ended),
                     ", ".join(brokers))

    def _may_take_over(self) -> bool:
        """Not while this broker's own lease is old (it may be the one cut off), nor for a
        lease after an outage of its renewals longer than two periods ended: every broker's
        lease may look expired when the metadata store comes back, and the others renew
        theirs meanwhile (a broker whose lease is due takes such a peer's silence for the
        store away for all: ``lease_watch.py``)."""
        owners = self.store.owners
        ended, silent = owners.outage_ended_at, owners.silence()
        return silent is not None and silent <= self.lease_s and not owners.shared_outage \
            and (ended is None or owners.outage_s <= MISSED_S  # a hiccup, not one
                 or time.monotonic() - ended >= self.lease_s)  # others' leases outlive

    def _write_under(self, epoch: int) -> None:
        """Fence, recover, seal and delete under ``epoch`` from now on."""
        for bookie in self.store.bookies.values():
            bookie.write_under(epoch)
        self.store.epoch = epoch

    def serve(self, partitions: list[tuple[str, int]]) -> list[RecoveryReport]:
        """Serve ``partitions``, claimed by this broker, that are not served yet: recover
        each one's open segment, then open a new one (one metadata transaction per topic).
        One at a time: the takeover thread and a call that finds its partition placed here
        never open one twice."""
        store = self.store
        with self._serving:
            with store.topics_lock:  # a growth opens its new partitions under it
                wanted = set(partitions) - store.serves()
            return self._serve(wanted) if wanted else []

    def serve_if_placed(self, topic: str, partition: int) -> bool:
        """A call for a partition not served here: when the metadata says it is this
        broker's (placed here, or handed here since the last renewal), it is opened now.
        Whether it is served here.

        One the lease's view gives to another broker is looked up too: an unload or a drain
        hands partitions over in the metadata and sends their clients here at once, while
        this broker's view names the former owner until its next renewal — trusted, it sent
        each of those clients back there, and a Pulsar subscribe retried until it timed out.
        Misdirected calls are few (a client follows the answer), so the read costs little;
        while the metadata is away the view answers."""
        if not self.store.owners.renewing():
            return False
        try:
            owner = self.store.owners.owner_of(topic, partition)
        except UnavailableError:
            return False
        if owner is None or owner.broker_id != self.store.owners.broker_id:
            return False
        self.serve([(topic, partition)])
        if (topic, partition) not in self.store.serves():
            return False
        self.store.owners.note(gained=[(topic, partition)])  # served already: the view too
        return True

    def _serve(self, wanted: set[tuple[str, int]]) -> list[RecoveryReport]:
        store = self.store
        adopted = store.owners.adopt()  # handed over at a higher epoch than this broker's
        if adopted is not None:
            self._write_under(adopted)
        reports = recover_open_segments(store.metadata, store.bookies,
                                        ack_quorum=store.ack_quorum, partitions=wanted)
        for topic in store.metadata.list_topics():
            mine = [p for p in range(topic.serving) if (topic.name, p) in wanted]
            if not mine:
                continue
            with store.topics_lock:
                opened = store.metadata.new_segments(
                    topic.name, [(p, store.choose_ensemble()) for p in mine],
                    created_at=now_ms())
                store.open_partitions(topic, opened)
        store.owners.note(gained=wanted)  # served here from now: not sent elsewhere
        return reports

    def start(self) -> None:
        """Look for orphans after every renewal of the lease, on a thread of its own (a
        takeover's recovery never delays a renewal)."""
        self.store.owners.after_renewal.append(self._wake.set)
        self._worker = Worker("broker-takeover", self._run,
                              on_error=self.store.thread_failed("the broker's takeovers"))
        self._worker.start()
        self.watch.start()

    def _run(self) -> None:
        assert self._worker is not None
        stopping = self._worker.stopping
        while not stopping.is_set() and not self.store.closing.is_set():
            self._wake.wait(RENEW_S)
            self._wake.clear()
            if stopping.is_set() or self.store.closing.is_set() or self.store.fenced.is_set():
                return
            version = self.store.owners.version
            if version != self._version and self.serve_placed():
                self._version = version
            self.take_over()
            self.watch.look()

    def _rejoin(self) -> None:
        """The lease was taken up again after a lapse: what is still this broker's is served
        again at the next pass (as if placed here)."""
        self._version = None
        self._wake.set()

    def serve_placed(self) -> bool:
        """Serve the partitions another broker placed here (a new topic's: ``place()``)
        that are not served yet. False: it failed, and is tried again after the next
        renewal."""
        try:
            with self._serving:
                # a scale event's new partitions are this broker's from its metadata commit,
                # opened by the growth under the topics lock a moment later: not placed
                with self.store.topics_lock:
                    placed = sorted(self.store.owners.mine() - self.store.serves())
                reports = self._serve(set(placed)) if placed else []
            if placed:
                log.info("%s serves %d partition(s) placed on it (%s)%s",
                         self.store.owners.broker_id, len(placed),
                         ", ".join(f"{t} partition {p}" for t, p in placed[:5]),
                         f"; {len(reports)} open segment(s) recovered" if reports else "")
            return True
        except TierstreamError as exc:
            log.warning("serving the partitions placed here failed, tried again after the "
                        "next renewal: %s", exc)
            return False

    def unload(self, partitions: list[tuple[str, int]], to: str | None = None
               ) -> dict[str, str]:
        """Move ``partitions``, served here, to the other live brokers (or to the broker
        ``to``), gracefully: each is sealed and served here no more (appends are refused
        with the new owner's address), then all are handed over in one transaction; the new
        owners open them at their next renewal, or at once when a client names one.
        ``{"topic/partition": new owner}``."""
        store, owners = self.store, self.store.owners
        wanted = sorted(set(partitions))
        with self._serving:
            where = {b["broker"]: b for b in owners.brokers()}
            if to is None:
                spread = owners.place(len(wanted), self.lease_ms, away=True)
            elif to not in where or to == owners.broker_id:
                raise ConfigError(f"cannot move partitions to {to!r}: not another broker of "
                                  "this store")
            else:
                spread = dict.fromkeys(range(len(wanted)), (to, int(where[to]["epoch"])))
            placed = {key: spread[i] for i, key in enumerate(wanted)}
            # where the new owners are reached, their Pulsar listener's too: this broker's
            # lookups send the partitions' clients there from now on
            given = {(t, p): Owner(b, e, now_ms(), where.get(b, {}).get("url"),
                                   where.get(b, {}).get("pulsar_url"))
                     for (t, p), (b, e) in placed.items()}
            served = store.serves()  # one placed here but not opened yet: only handed over
            try:
                for (topic, partition), owner in given.items():
                    if (topic, partition) not in served:
                        continue
                    plog = store.partition(topic, partition)
                    with plog.lock:  # no append between the seal and the refusal
                        plog.close()
                        plog.lose(owners.refusal(topic, partition, owner))
                owners.hand_over(placed)
                owners.note(given=given)
            except TierstreamError:
                self._serve(set(wanted) - store.serves())  # still this broker's: serve on
                raise
        log.warning("%s moved %d partition(s) to other brokers: %s", owners.broker_id,
                    len(placed), ", ".join(f"{t} partition {p} to {b}"
                                           for (t, p), (b, _) in list(placed.items())[:5]))
        return {f"{t}/{p}": broker for (t, p), (broker, _) in placed.items()}

    def unload_topic(self, topic: str, partition: int | None, to: str | None = None
                     ) -> dict[str, str]:
        """``topic unload``: the partition named (one served elsewhere is refused, naming its
        owner: the client follows), or every partition of ``topic`` served here, moved to
        the other brokers (or to ``to``: a broker growing the topic gathers its partitions).
        ``{"topic/partition": new owner}``."""
        if partition is None:
            keys = sorted(k for k in self.store.owners.mine() if k[0] == topic)
        else:
            self.store.owners.serving(topic, int(partition))  # another's: it is refused
            plog = self.store.partition(topic, int(partition))  # not served: refused
            keys = [] if plog.lost else [(topic, int(partition))]
        return self.unload(keys, to) if keys else {}

    def drain(self) -> dict[str, str]:
        """``broker drain``: every partition this broker owns (served, or placed here and not
        opened yet), moved to the other brokers."""
        return self.unload(sorted(self.store.owners.mine()))

    def place(self, partitions: int) -> dict[int, tuple[str, int]]:
        """Where a new topic's partitions go (those on other brokers): spread over the live
        brokers by how many partitions each owns."""
        return self.store.owners.place(partitions, self.lease_ms)

    def take_over(self) -> list[tuple[str, int]]:
        """Claim and serve this broker's share of the orphans now; said in the log."""
        try:
            taken = self.claim()
            if taken:
                started = now_ms()
                reports = self.serve(taken)
                self.taken_over += len(taken)
                log.warning("%s took over %d partition(s) whose owner's lease expired (%s), "
                            "at epoch %d; %d open segment(s) recovered in %d ms",
                            self.store.owners.broker_id, len(taken),
                            ", ".join(f"{t} partition {p}" for t, p in taken[:5]),
                            self.store.epoch, len(reports), now_ms() - started)
            return taken
        except TierstreamError as exc:  # the metadata or bookies away: the next renewal
            log.warning("taking partitions over failed, tried again after the next "
                        "renewal: %s", exc)
            return []

    def stop(self) -> None:
        self.watch.stop()
        if self._worker is not None:
            self._wake.set()
            self._worker.stop()
        self.peers.close()


def refuse_beside_a_cluster(metadata: MetadataStore, *, standby: bool) -> None:
    """A broker about to serve the store alone (no ``--cluster``) refuses a store that live
    cluster brokers serve, naming them (ConflictError): it would claim every partition from
    them at once. They are known by their sessions' names (:func:`_session_name`)."""
    if metadata.backend.dialect != "postgresql":
        return  # a SQLite store has no cluster
    rows = metadata.query("SELECT DISTINCT application_name FROM pg_stat_activity WHERE "
                          "datname = current_database() AND application_name LIKE ?",
                          (_session_name("%"),))
    brokers = sorted(str(name).split("/", 1)[1] for (name,) in rows)
    if brokers:
        raise ConflictError(
            f"the metadata store {metadata.backend.name} is served by brokers started with "
            f"--cluster ({', '.join(brokers)}), each owning some of its partitions: start "
            "this one with --cluster too" + (
                ", without --standby (a cluster broker started later owns nothing until "
                "partitions are created, orphaned or moved to it: a cluster's standby)"
                if standby else ""))


def _session_name(broker_id: str) -> str:
    """The application_name of a cluster broker's metadata sessions."""
    return f"{BROKER_APPLICATION}/{broker_id}"


def cluster_of(store: ClusterStore) -> Cluster:
    """The store's cluster, or ConfigError: moving partitions is for cluster brokers."""
    if store.cluster is None:
        raise ConfigError("moving partitions is for brokers started with --cluster: this one "
                          "serves the store alone")
    return store.cluster
