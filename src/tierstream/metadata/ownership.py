"""Which broker serves each partition: a claim per partition, with its writer epoch.

A row of ``partition_owners`` names the broker that owns a partition and the epoch of its
claim; ``brokers`` says where each broker is reached. Every change of a partition's segments
— a new segment, a seal — is made in a transaction that first checks, in the same
transaction, that the writing broker still owns the partition at its epoch
(:meth:`PartitionOwners.hold`, :meth:`PartitionOwners.check`): a broker that lost a
partition cannot add to it or seal in it again, and is told who owns it now
(:class:`~tierstream.errors.NotOwnerError`).

Claims only go up: a claim replaces an owner of a lower epoch, never one of a higher epoch (a
broker that took a partition over is never displaced by the one it took it from). Epochs come
from the store's one counter (``bookie_registry.take_writer_epoch``), which bookies fence
ledgers by.

The **lease**: every second a broker renews its ``brokers.heartbeat_at`` by the metadata
server's clock (:meth:`PartitionOwners.renew`), and reads which partitions are owned
elsewhere, only when they changed: every write of an owner or of a broker's address bumps
``meta.owners_version`` in its transaction (``segment_rows.owners_changed``), and a renewal
that finds the version it read last reads nothing more. Its Flight streams refuse those
(:meth:`PartitionOwners.serving`) with a NotOwnerError that carries the owner's address,
which tierstream's clients follow.

A broker serving a store alone (the data directory's lock, or the PostgreSQL advisory lock
of ``leader_lease.py``) claims every partition when it opens the store, at the epoch it opened
it under. Brokers of a cluster (``broker start --cluster``,
``broker/cluster/membership.py``) claim the
partitions no live broker owns (:meth:`PartitionOwners.orphans`,
:meth:`PartitionOwners.take_over`), each takeover at a new epoch, and place a new topic's
partitions over the live brokers (:meth:`PartitionOwners.place`): a broker's claims may carry
several epochs, so a claim is this broker's by its id (unique per start), and the epoch
orders claims.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tierstream.errors import ConflictError, NotOwnerError
from tierstream.metadata.backend import Tx
from tierstream.metadata.owner_rows import (
    OWNER_SELECT,
    Owner,
    owner_in,
    owner_row,
    owners_in,
    refusal_text,
    refused_in,
)
from tierstream.metadata.segment_rows import owners_changed
from tierstream.metadata.store import MetadataStore
from tierstream.util.timeutil import now_ms

__all__ = ["MISSED_S", "RENEW_S", "Owner", "PartitionOwners"]

log = logging.getLogger(__name__)

#: how often a broker renews its lease and its view of the partitions owned elsewhere
RENEW_S = 1.0
#: a broker silent past this missed a renewal: its metadata store is away (an outage, not
#: a hiccup; a lapsing broker takes a peer this silent for the store away for it too)
MISSED_S = 2 * RENEW_S

class PartitionOwners:
    """The partitions of ``metadata`` as the broker ``broker_id``, writing under ``epoch``,
    claims and holds them."""

    def __init__(self, metadata: MetadataStore, broker_id: str, epoch: int) -> None:
        self.metadata, self.broker_id, self.epoch = metadata, broker_id, epoch
        self._clock = metadata.backend.clock_ms
        #: the partitions other brokers own, as the last renewal read them (serving())
        self._elsewhere: dict[tuple[str, int], Owner] = {}
        self._view = threading.Lock()  # a renewal's view against a claim's
        #: when the lease was last renewed (monotonic s; None: not yet), and when that
        #: renewal started (the lease runs from there: ``lease.py``)
        self.renewed_at: float | None = None
        self.lease_from: float | None = None
        #: where this broker said it is reached (advertise())
        self.advertised: tuple[str, str | None, str | None] | None = None
        self._version: str | None = None  # meta.owners_version the view was read at
        self._noted = 0  # changes this broker made to its own view (note())
        #: called with the partitions a renewal found owned elsewhere that were not before
        #: (the store stops serving them, the subscriptions let their consumers go)
        self.on_lost: list[Callable[[dict[tuple[str, int], Owner]], None]] = []
        #: called after each renewal the lease thread made (several brokers: takeovers)
        self.after_renewal: list[Callable[[], None]] = []
        #: the metadata store is away for every live broker: none can take a partition over,
        #: and this one serves on past its lease until its renewal says what is its own
        #: (``lease.py``)
        self.shared_outage = False
        self.outage_ended_at: float | None = None  # monotonic; takeovers wait a lease after
        self.outage_s = 0.0  # how long that outage of the renewals was

    def __repr__(self) -> str:
        return f"PartitionOwners(broker={self.broker_id!r}, epoch={self.epoch})"

    @property
    def version(self) -> str | None:
        """``meta.owners_version`` as the last renewal read it: it moves with every claim,
        placement and address."""
        return self._version

    def claim(self, partitions: Iterable[tuple[str, int]]) -> dict[str, int]:
        """Own ``partitions`` from now on, in one transaction; every one owned at a lower
        epoch is taken over. Returns how many were taken from each former owner. One owned at
        a higher epoch is refused (NotOwnerError), and nothing is claimed."""
        wanted = sorted(set(partitions))
        at = now_ms()
        with self.metadata.atomic() as c:
            # every owner in one read: a takeover's time does not grow with round trips
            owners = {(t, p): b for t, p, b in c.execute(
                "SELECT topic, partition, broker_id FROM partition_owners").fetchall()}
            former: dict[str, int] = {}
            for key in wanted:
                broker_id = owners.get(key)
                if broker_id is not None and broker_id != self.broker_id:
                    former[broker_id] = former.get(broker_id, 0) + 1
            # never lowers an epoch, also against a claim committed after the read above
            c.executemany(
                "INSERT INTO partition_owners (topic, partition, broker_id, epoch, claimed_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, partition) DO UPDATE SET "
                "broker_id=excluded.broker_id, epoch=excluded.epoch, "
                "claimed_at=excluded.claimed_at WHERE partition_owners.epoch <= excluded.epoch",
                [(topic, partition, self.broker_id, self.epoch, at)
                 for topic, partition in wanted])
            owners_changed(c)
            keys = set(wanted)
            newer = [(t, p) for t, p in c.execute(
                "SELECT topic, partition FROM partition_owners WHERE epoch > ?",
                (self.epoch,)).fetchall() if (t, p) in keys]
            if newer:  # the transaction is rolled back: nothing is claimed
                topic, partition = min(newer)
                raise refused_in(c, topic, partition, "claim")
            # brokers that own nothing any more are forgotten (every start is a new broker)
            c.execute("DELETE FROM brokers WHERE broker_id <> ? AND broker_id NOT IN "
                      "(SELECT broker_id FROM partition_owners)", (self.broker_id,))
        self.note(gained=wanted)
        return former

    def claim_store(self) -> None:
        """Own every partition of the store — those a topic serves and those with a segment
        left open (recovery seals it) — and bind this broker to the metadata: from now on
        each new segment and seal checks that it still owns its partition."""
        partitions = self.metadata.partitions()
        former = self.claim(partitions)
        self.metadata.owner = self
        if former:
            log.info("%s (epoch %d) owns the store's %d partitions, taken over from %s",
                     self.broker_id, self.epoch, len(partitions),
                     ", ".join(f"{b} ({n})" for b, n in sorted(former.items())))

    def join(self) -> None:
        """Start this broker's lease before it claims anything (its address follows:
        :meth:`advertise`): brokers of a cluster take over only the partitions of brokers
        whose lease expired."""
        started = time.monotonic()
        with self.metadata.atomic() as c:
            c.execute("INSERT INTO brokers (broker_id, url, epoch, started_at, heartbeat_at) "
                      f"VALUES (?, '', ?, ?, {self._clock}) ON CONFLICT (broker_id) DO "
                      "UPDATE SET heartbeat_at=excluded.heartbeat_at",
                      (self.broker_id, self.epoch, now_ms()))
        self.renewed_at, self.lease_from = time.monotonic(), started

    def expired(self, lease_ms: int) -> list[str]:
        """The brokers whose lease is older than ``lease_ms`` (what they own is orphaned)."""
        return [str(b) for (b,) in self.metadata.query(
            f"SELECT broker_id FROM brokers WHERE {self._clock} - heartbeat_at > ?",
            (lease_ms,))]

    def orphans(self, candidates: Iterable[tuple[str, int]], lease_ms: int
                ) -> tuple[list[tuple[str, int]], int]:
        """Of ``candidates``, those no live broker owns (no owner, or an owner whose lease
        is older than ``lease_ms`` by the server's clock), and this broker's fair share of
        all of them: how many more it may take, so that the live brokers own about as many
        each. One read."""
        wanted = set(candidates)
        with self.metadata.atomic() as c:
            live = {str(b) for (b,) in c.execute(
                f"SELECT broker_id FROM brokers WHERE {self._clock} - heartbeat_at <= ?",
                (lease_ms,)).fetchall()} | {self.broker_id}
            owners = {(t, int(p)): str(b) for t, p, b in c.execute(
                "SELECT topic, partition, broker_id FROM partition_owners").fetchall()}
        mine = sum(1 for k in wanted if owners.get(k) == self.broker_id)
        share = -(-len(wanted) // len(live))  # ceiling: the first to look takes the rest
        return sorted(k for k in wanted if owners.get(k) not in live), max(0, share - mine)

    def place(self, partitions: int, lease_ms: int, *, away: bool = False
              ) -> dict[int, tuple[str, int]]:
        """Where ``partitions`` (a new topic's; with ``away``, partitions this broker lets
        go) go: each to the live broker owning the fewest partitions then (this one on a
        tie, never with ``away``). Returns those placed on other brokers, with each one's
        epoch: ``{partition: (broker, epoch)}``."""
        rows = self.metadata.query(
            "SELECT b.broker_id, b.epoch, (SELECT COUNT(*) FROM partition_owners o WHERE "
            f"o.broker_id = b.broker_id) FROM brokers b WHERE {self._clock} - b.heartbeat_at "
            "<= ? AND b.url <> ''", (lease_ms,))
        load = {str(b): [int(n), int(e)] for b, e, n in rows}
        load.setdefault(self.broker_id, [self.owned(), self.epoch])
        if away:
            del load[self.broker_id]
            if not load:
                raise ConflictError(f"{self.broker_id} has no other live broker to move "
                                    "partitions to: start another with --cluster")
        placed = {}
        for partition in range(partitions):
            broker = min(load, key=lambda b: (load[b][0], b != self.broker_id, b))
            load[broker][0] += 1
            if broker != self.broker_id:
                placed[partition] = (broker, load[broker][1])
        return placed

    def hand_over(self, placed: dict[tuple[str, int], tuple[str, int]]) -> None:
        """Give each partition (sealed, served here no more) to the broker ``placed`` names,
        in one transaction, at its epoch or the claim's if higher (a takeover's, which fenced
        ledgers of it at that epoch: :meth:`adopt`). One no longer this broker's:
        NotOwnerError."""
        at = now_ms()
        with self.metadata.atomic() as c:
            for (topic, partition), (broker, epoch) in sorted(placed.items()):
                moved = c.execute("UPDATE partition_owners SET broker_id=?, epoch=CASE WHEN "
                                  "epoch > ? THEN epoch ELSE ? END, claimed_at=? WHERE topic=? "
                                  "AND partition=? AND broker_id=?",
                                  (broker, epoch, epoch, at, topic, partition, self.broker_id))
                if moved.rowcount != 1:
                    raise refused_in(c, topic, partition, "hand over")
            owners_changed(c)

    def note(self, gained: Iterable[tuple[str, int]] = (),
             given: dict[tuple[str, int], Owner] | None = None) -> None:
        """Partitions this broker just opened (``gained``) or handed over (``given``, to
        whom; told to :attr:`on_lost` now) are so in :meth:`serving`'s view at once: their
        clients are not sent back."""
        with self._view:
            for key in gained:
                self._elsewhere.pop(key, None)
            self._elsewhere.update(given or {})
            self._noted += 1  # a renewal that read the owners before this is not applied
        for listener in self.on_lost if given else ():
            listener(dict(given or {}))

    def adopt(self) -> int | None:
        """Write under the highest epoch of this broker's claims from now on, if above its
        own (a partition handed over keeps the epoch of the takeover that fenced its older
        ledgers, and the bookies refuse a seal or delete of them below it). The new epoch,
        or None if it stays."""
        with self.metadata.atomic() as c:
            (highest,) = c.execute("SELECT MAX(epoch) FROM partition_owners WHERE "
                                   "broker_id=?", (self.broker_id,)).fetchone()
            if highest is None or int(highest) <= self.epoch:
                return None
            c.execute("UPDATE brokers SET epoch=? WHERE broker_id=?", (highest, self.broker_id))
        self.epoch = int(highest)
        return self.epoch

    def mine(self) -> set[tuple[str, int]]:
        """The partitions this broker owns, as the metadata has them."""
        return {(str(t), int(p)) for t, p in self.metadata.query(
            "SELECT topic, partition FROM partition_owners WHERE broker_id=?",
            (self.broker_id,))}

    def take_over(self, partitions: Sequence[tuple[str, int]], epoch: int, lease_ms: int
                  ) -> list[tuple[str, int]]:
        """Claim each of ``partitions`` at ``epoch`` (a new writer epoch, above every
        earlier claim's) if, in this transaction, it is still owned by no live broker: a
        partition another broker claimed meanwhile, or whose owner renewed its lease, is
        left (compare-and-set, safe against brokers taking over at once). From now on this
        broker claims at ``epoch``. Returns those claimed."""
        at = now_ms()
        with self.metadata.atomic() as c:
            for topic, partition in partitions:
                c.execute("INSERT INTO partition_owners (topic, partition, broker_id, epoch, "
                          "claimed_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, partition) "
                          "DO UPDATE SET broker_id=excluded.broker_id, epoch=excluded.epoch, "
                          "claimed_at=excluded.claimed_at WHERE partition_owners.epoch < "
                          "excluded.epoch AND NOT EXISTS (SELECT 1 FROM brokers b WHERE "
                          "b.broker_id = partition_owners.broker_id AND "
                          f"{self._clock} - b.heartbeat_at <= ?)",
                          (topic, partition, self.broker_id, epoch, at, lease_ms))
            owners_changed(c)
            c.execute("UPDATE brokers SET epoch=? WHERE broker_id=?", (epoch, self.broker_id))
            keys = set(partitions)
            taken = sorted((str(t), int(p)) for t, p in c.execute(
                "SELECT topic, partition FROM partition_owners WHERE broker_id=? AND epoch=?",
                (self.broker_id, epoch)).fetchall() if (t, int(p)) in keys)
            c.execute("DELETE FROM brokers WHERE broker_id <> ? AND broker_id NOT IN "
                      "(SELECT broker_id FROM partition_owners) AND "
                      f"{self._clock} - heartbeat_at > ?", (self.broker_id, lease_ms))
        self.epoch = epoch
        self.note(gained=taken)
        return taken

    def release(self) -> None:
        """Let go of every partition, and of the lease (a cluster broker stopping cleanly):
        other brokers take them over at their next renewal, not once the lease expired."""
        with self.metadata.atomic() as c:
            c.execute("DELETE FROM partition_owners WHERE broker_id=?", (self.broker_id,))
            c.execute("DELETE FROM brokers WHERE broker_id=?", (self.broker_id,))
            owners_changed(c)

    def advertise(self, url: str, pulsar_url: str | None = None,
                  admin_url: str | None = None) -> None:
        """Say where this broker is reached: its Flight URL, its Pulsar listener's and its
        Pulsar admin REST's (again, with what it said last: :attr:`advertised`)."""
        self.advertised = (url, pulsar_url, admin_url)
        with self.metadata.atomic() as c:
            c.execute("INSERT INTO brokers (broker_id, url, pulsar_url, admin_url, epoch, "
                      f"started_at, heartbeat_at) VALUES (?, ?, ?, ?, ?, ?, {self._clock}) "
                      "ON CONFLICT (broker_id) DO UPDATE SET url=excluded.url, "
                      "pulsar_url=excluded.pulsar_url, admin_url=excluded.admin_url, "
                      "heartbeat_at=excluded.heartbeat_at",
                      (self.broker_id, url, pulsar_url, admin_url, self.epoch, now_ms()))
            owners_changed(c)

    def renew(self) -> None:
        """Renew this broker's lease (its heartbeat, by the server's clock) and read which
        partitions other brokers own: what :meth:`serving` refuses until the next renewal.
        The owners are read only when ``meta.owners_version`` moved since the last renewal."""
        noted, started = self._noted, time.monotonic()
        with self.metadata.atomic() as c:
            c.execute(f"UPDATE brokers SET heartbeat_at = {self._clock} WHERE broker_id=?",
                      (self.broker_id,))
            row = c.execute("SELECT value FROM meta WHERE key='owners_version'").fetchone()
            version = None if row is None else str(row[0])
            if version is not None and version == self._version:
                self._renewed(started)
                return
            rows = c.execute(
                OWNER_SELECT.format(heard="NULL").replace(
                    "SELECT ", "SELECT o.topic, o.partition, ", 1) + " WHERE o.broker_id <> ?",
                (self.broker_id,)).fetchall()
        elsewhere = {(row[0], int(row[1])): owner_row(row[2:]) for row in rows}
        with self._view:
            self._renewed(started)
            if noted != self._noted:  # this broker gained or gave partitions meanwhile: the
                self._version = None  # rows may be older than that; read again next time
                return
            lost = {k: o for k, o in elsewhere.items() if k not in self._elsewhere}
            self._elsewhere = elsewhere
            self._version = version
        if lost:
            for listener in self.on_lost:
                try:
                    listener(lost)
                except Exception:  # the lease goes on; the stack is a bug to report
                    log.exception("letting go of the partitions lost failed")

    def _renewed(self, started: float) -> None:
        # the heartbeat was written after the session it went through was opened: a renewal
        # that waited out an outage (its start long gone) renewed the lease as of then.
        # Counted from its start, the lease lapsed at once after PostgreSQL came back.
        started = max(started, self.metadata.backend.connected_at)
        now = time.monotonic()  # an outage ends at a renewal later than two periods
        if self.renewed_at is not None and now - self.renewed_at > MISSED_S:
            self.outage_ended_at, self.outage_s = now, now - self.renewed_at
        self.renewed_at, self.lease_from = now, started

    def silence(self) -> float | None:
        """Seconds since the lease was last renewed (None: never)."""
        return None if self.renewed_at is None else time.monotonic() - self.renewed_at

    def renewing(self) -> bool:
        """Whether the metadata store answers the renewals (none missed): a read of it now
        would be answered, rather than wait as they do."""
        silent = self.silence()
        return silent is None or silent <= MISSED_S

    def serving(self, topic: str, partition: int) -> None:
        """Before a stream of the partition is served here (and at each batch a producer
        sends): NotOwnerError, with the owner's address, when another broker owns it by the
        last renewal. No metadata read: a stream opens at memory speed."""
        owner = self._elsewhere.get((topic, partition))
        if owner is not None:
            raise self.refusal(topic, partition, owner)

    def refusal(self, topic: str, partition: int, owner: Owner) -> NotOwnerError:
        """The error that sends a partition's clients to ``owner``."""
        return NotOwnerError(f"{topic} partition {partition} is served by {owner.describe()}, "
                             f"not by {self.broker_id}: its clients go there",
                             owner_url=owner.url)

    def hold(self, c: Tx, topic: str, partitions: Sequence[int]) -> None:
        """In transaction ``c``, before new segments of ``topic``'s ``partitions`` are added
        (one read for all): this broker owns each at its epoch, or one owned by nobody yet is
        claimed (a new partition is owned by the broker that opens it). One owned elsewhere:
        NotOwnerError."""
        owners = owners_in(c, topic)
        for partition in partitions:
            if owners.get(partition, (self.broker_id, 0))[0] != self.broker_id:
                raise refused_in(c, topic, partition, "write to")
        new = sorted(p for p in set(partitions) if p not in owners)
        if not new:
            return
        at = now_ms()
        # a broker opening the same new partition at once may commit its claim first: the
        # first claim stands, and the other is refused (not a unique-key crash)
        c.executemany("INSERT INTO partition_owners (topic, partition, broker_id, epoch, "
                      "claimed_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, partition) "
                      "DO NOTHING", [(topic, p, self.broker_id, self.epoch, at) for p in new])
        owners_changed(c)
        now = owners_in(c, topic)
        for partition in new:
            if now.get(partition, ("", 0))[0] != self.broker_id:
                raise refused_in(c, topic, partition, "open")

    def foreign(self, c: Tx, partitions: set[tuple[str, int]]) -> dict[tuple[str, int], str]:
        """In transaction ``c``: of ``partitions``, those another broker owns (or this one
        under an older claim), with the owner's id; one read per topic."""
        out = {}
        for topic in sorted({t for t, _ in partitions}):
            for p, (b, _) in owners_in(c, topic).items():
                if (topic, p) in partitions and b != self.broker_id:
                    out[(topic, p)] = b
        return out

    def check(self, c: Tx, topic: str, partition: int) -> None:
        """In transaction ``c``, before the partition's segments change: this broker owns it
        at its epoch, or NotOwnerError names the owner (or says nobody does)."""
        owner = owner_in(c, topic, partition)
        if owner is None or owner.broker_id != self.broker_id:
            raise NotOwnerError(refusal_text(topic, partition, owner, "write to"))

    def owner_of(self, topic: str, partition: int) -> Owner | None:
        """The owner of one partition, or None."""
        rows = self.metadata.query(self._select() + " WHERE o.topic=? AND o.partition=?",
                                   (topic, partition))
        return owner_row(rows[0]) if rows else None

    def others(self) -> list[Owner]:
        """The other brokers that own a partition by the last renewal, one each."""
        with self._view:
            return list({o.broker_id: o for o in self._elsewhere.values()}.values())

    def elsewhere(self, topic: str, partition: int) -> Owner | None:
        """The partition's owner when it is another broker by the last renewal (a Pulsar
        lookup is sent there), else None. No metadata read: lookups are answered while the
        metadata server is away, from the view :meth:`serving` refuses streams by."""
        return self._elsewhere.get((topic, partition))

    def of_topic(self, topic: str) -> dict[int, Owner]:
        """The owner of each of ``topic``'s partitions that has one."""
        return {row[0]: owner_row(row[1:]) for row in self.metadata.query(
            self._select().replace("SELECT ", "SELECT o.partition, ", 1) + " WHERE o.topic=?",
            (topic,))}

    def _select(self) -> str:
        """:data:`OWNER_SELECT` with the age of each owner's lease, by the server's clock."""
        return OWNER_SELECT.format(heard=f"{self._clock} - b.heartbeat_at")

    def brokers(self) -> list[dict[str, Any]]:
        """Every broker the metadata knows: where it is reached, its epoch, how many
        partitions it owns, and how long ago it renewed its lease (by the server's clock)."""
        rows = self.metadata.query(
            f"SELECT b.broker_id, b.epoch, b.url, b.pulsar_url, b.started_at, "
            f"{self._clock} - b.heartbeat_at, (SELECT COUNT(*) FROM partition_owners o "
            "WHERE o.broker_id = b.broker_id) FROM brokers b "
            "ORDER BY b.broker_id")
        return [{"broker": str(b), "epoch": int(e), "url": url, "pulsar_url": pulsar_url,
                 "started_at": int(started), "heard_ms_ago": None if heard is None else
                 int(heard), "partitions": int(n), "this": b == self.broker_id}
                for b, e, url, pulsar_url, started, heard, n in rows]

    def owned(self) -> int:
        """How many partitions this broker owns."""
        (count,) = self.metadata.query(
            "SELECT COUNT(*) FROM partition_owners WHERE broker_id=?", (self.broker_id,))[0]
        return int(count)
