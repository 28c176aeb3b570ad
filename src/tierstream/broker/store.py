"""The embedded store: metadata, bookies and one managed ledger per partition.

This is what the broker serves. Opening it recovers from a crash (segments left OPEN are sealed
at their last durable entry) and opens a fresh segment for every partition.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstream.bookie.storage import Bookie
from tierstream.broker.cluster.membership import Cluster, refuse_beside_a_cluster
from tierstream.broker.cluster.owned_partitions import OwnedPartitions
from tierstream.broker.config import StoreConfig
from tierstream.broker.data_dir import lock_data_dir, prepare_data_dir, unlock_data_dir
from tierstream.broker.topics.auto_scale import AutoScaler
from tierstream.broker.topics.deletion import purge_topic
from tierstream.broker.topics.growth import Growth
from tierstream.broker.topics.housekeeping import report_failure, run_housekeeping
from tierstream.broker.topics.key_routing import KeyRouting
from tierstream.broker.topics.offload import Offloader
from tierstream.broker.topics.recovery import RecoveryReport, recover_open_segments
from tierstream.broker.transactions.coordinator import TransactionCoordinator
from tierstream.errors import (
    ConfigError,
    FencedError,
    NotOwnerError,
    StorageError,
    UnavailableError,
)
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.bookies.local import LocalBookie
from tierstream.managed_ledger.bookies.placement import (
    choose_ensemble,
    connect_network_bookies,
    resolve_quorums,
)
from tierstream.managed_ledger.bookies.repair import Repairer
from tierstream.managed_ledger.partition_log import PartitionLog
from tierstream.metadata.bookie_registry import take_writer_epoch
from tierstream.metadata.lease import Lease
from tierstream.metadata.ownership import PartitionOwners
from tierstream.metadata.records import SegmentRecord, TopicRecord
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.model.positions import Position
from tierstream.tier.catalog import TierCatalog
from tierstream.util.faults import crash_point
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

__all__ = ["Store"]

log = logging.getLogger(__name__)


class Store(OwnedPartitions):
    """The embedded log store of one data directory. Only one process may open it to write."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._lock_file: Any = None

        def hold_data_dir() -> None:
            if self._lock_file is None:
                prepare_data_dir(config.data_dir)
                self._lock_file = lock_data_dir(config.data_dir, config.layout.lock)

        #: set (with the reason) when a thread the broker needs died of an error nobody
        #: foresaw (housekeeping, the subscriptions' timer, cursor writer, dead-letter writer,
        #: a local bookie's journal): the broker stops (broker/run.py); others serve on
        self.failed = threading.Event()
        self.failed_reason = ""

        # metadata on PostgreSQL is checked (reachable, not held by another broker) before
        # anything is created here; a standby holds its data directory while it waits, so
        # that `broker stop` finds it and a second broker on the directory is refused
        try:
            remote = MetadataStore(config.metadata_url,
                                   takeover_after_s=config.takeover_after_s,
                                   on_standby=hold_data_dir,
                                   hold=config.lease_timeout_s is None) \
                if config.metadata_url else None
        except BaseException:  # a standby that stood by, then failed (or was stopped)
            if self._lock_file is not None:
                unlock_data_dir(self._lock_file)
            raise
        try:
            hold_data_dir()
        except BaseException:
            if remote is not None:
                remote.close()
            raise
        try:
            self.metadata = remote or MetadataStore(config.metadata_path)
            self.metadata.backend.refresh_statistics()  # plans need them (postgres.py)
            #: this broker's writer epoch: bookies refuse writes of lower epochs to a ledger
            #: once a newer broker fenced it (bookie/storage.py)
            self.epoch = take_writer_epoch(self.metadata)
            self.bookies: dict[str, BookieClient] = connect_network_bookies(
                self.metadata, self.epoch, auth_token=config.bookie_token,
                tls_ca=config.bookie_tls_ca, timeout_s=config.bookie_timeout_s) \
                if config.network_bookies else {
                    f"bookie-{i}": LocalBookie(Bookie(
                        f"bookie-{i}", config.bookie_dir(f"bookie-{i}"), fsync=config.fsync,
                        max_open=config.max_open_ledgers,
                        on_failure=self.thread_failed(f"the journal of bookie-{i}")))
                    for i in range(config.bookies)}
            self.write_quorum, self.ack_quorum = resolve_quorums(
                config.write_quorum, config.ack_quorum, len(self.bookies))
        except BaseException as exc:
            unlock_data_dir(self._lock_file)
            if remote is not None:
                remote.close()
            if isinstance(exc, OSError):
                raise StorageError(f"cannot open the store in {str(config.data_dir)!r}: "
                                   f"{exc.strerror or exc}") from None
            raise
        self.closing = threading.Event()  # set: tail reads end, housekeeping stops
        #: set (with the reason) when a bookie refused this broker's writes as fenced: a
        #: newer broker took the store over; this one stops (broker/run.py)
        self.fenced = threading.Event()
        self.fenced_reason = ""
        self._closed = False
        self.tier = config.tier()
        self._offloader: Offloader | None = None
        self._rr = itertools.count()
        self._short: set[str] = set()  # bookies unavailable at the last placement (told once)
        self._logs: dict[tuple[str, int], PartitionLog] = {}
        self._known: dict[str, TopicRecord] = {}  # the last record read of each topic
        self.topics_lock = threading.Lock()
        self.key_routing = KeyRouting(self.metadata, self.topics_lock)  # key_routing.py
        # A commit shows its entries in every partition under this lock, and the last
        # confirmed positions of a topic are read under it: a cut has all of a commit or none.
        self.visibility = threading.Lock()
        #: this broker owns every partition of the store: claimed before any is recovered or
        #: written, and checked at every new segment and seal from then on (ownership.py)
        self.owners = PartitionOwners(self.metadata, f"broker-{self.epoch}", self.epoch)
        self.lease = Lease(self.owners, config.lease_timeout_s)  # renewed from the start on
        #: one of several brokers serving the store (``--cluster``: broker/cluster/membership.py)
        self.cluster = None if config.lease_timeout_s is None else \
            Cluster(self, config.lease_timeout_s)
        served: set[tuple[str, int]] | None = None  # this broker's partitions: all, alone
        if self.cluster is None:
            refuse_beside_a_cluster(self.metadata, standby=config.takeover_after_s is not None)
            self.owners.claim_store()
        else:
            served = self.cluster.join()
        self.purge_deleted_topics()  # a deletion a crash interrupted is finished first
        self.recovery: list[RecoveryReport] = recover_open_segments(
            self.metadata, self.bookies, ack_quorum=self.ack_quorum, partitions=served)
        self.repairer = Repairer(self.metadata, self.bookies, self.write_quorum,
                                 self._segment_updated, seal=self._seal_lost, serves=None
                                 if self.cluster is None else self.serves,
                                 audit_interval_s=config.bookie_audit_interval_s)
        for report in self.recovery:
            if report.missing_replicas:
                self.repairer.suspect(report.segment_id, f"recovered without "
                                      f"{report.missing_replicas} of its bookies")
        for topic in self.metadata.list_topics():
            # every partition's new open segment in one metadata transaction
            mine = [p for p in range(topic.serving) if served is None or (topic.name, p) in
                    served]
            opened = self.metadata.new_segments(
                topic.name, [(p, self.choose_ensemble()) for p in mine],
                created_at=now_ms()) if mine else []
            self.open_partitions(topic, opened)
        self.transactions = TransactionCoordinator(
            self, timeout_ms=config.transaction_timeout_ms, elsewhere=None if self.cluster is
            None else self.cluster.txn_owners)
        self.transactions.recover()  # a commit a crash interrupted is finished first
        self.growth = Growth(self.metadata, self._logs,
                             locks=(self.transactions.commit_lock, self.topics_lock),
                             choose_ensemble=self.choose_ensemble, open_topic=self.open_partitions,
                             max_partitions=config.max_partitions_per_topic,
                             client_refresh_wait_ms=config.client_refresh_wait_ms,
                             gathered=None if self.cluster is None
                             else self.cluster.topics.gathered)
        self.auto_scale = None if config.auto_scale_rate is None else AutoScaler(
            self, config.auto_scale_rate, config.auto_scale_window_ms,
            max_partitions=config.max_partitions_per_topic, sample_every_s=0.0 if
            self.cluster is None else max(1.0, config.auto_scale_window_ms / 8000))
        self._timer = Worker("store-housekeeping", lambda: run_housekeeping(self),
                             on_error=self.thread_failed("the store's housekeeping"))
        self._timer.start()
        self.owners.on_lost.append(self._lose)
        self.owners.renew()  # the lease, then every second (ownership.py)
        self._lease = Worker("broker-lease", lambda: self.lease.keep(self.closing),
                             on_error=self.thread_failed("the broker's lease"))
        self._lease.start()
        if self.cluster is not None:
            self.cluster.start()

    def __repr__(self) -> str:
        return f"Store(data_dir={str(self.config.data_dir)!r}, topics={len(self.topics())})"

    def choose_ensemble(self) -> tuple[str, ...]:
        return choose_ensemble(self.bookies, self.write_quorum, self.ack_quorum,
                               next(self._rr), self._short)

    def _on_sealed(self, record: SegmentRecord, degraded: bool) -> None:
        if degraded:
            self.repairer.suspect(record.segment_id, "sealed while a bookie of it did not "
                                                     "answer")
        elif len(record.ensemble) < self.write_quorum:
            self.repairer.suspect(record.segment_id, f"placed on {len(record.ensemble)} "
                                  f"bookies, below the write quorum {self.write_quorum}")

    def _seal_lost(self, record: SegmentRecord) -> None:
        plog = self._logs.get((record.topic, record.partition))
        if plog is not None and plog.seal_if_open(record.segment_id):
            log.warning("segment %d (%s partition %d) sealed early: a bookie of it lost its "
                        "copy; it is re-replicated", record.segment_id, record.topic,
                        record.partition)

    def _segment_updated(self, record: SegmentRecord) -> None:
        plog = self._logs.get((record.topic, record.partition))
        if plog is not None:
            plog.update_segment(record)

    def check_serving(self) -> None:
        """FencedError (an UnavailableError: clients go to the next broker named) once this
        broker no longer serves the store: fenced by a newer one, or its metadata taken over
        or lost. A broker in that state stops within a second; until then it takes no call."""
        if self.fenced.is_set():
            raise FencedError(f"{self.fenced_reason}: this broker no longer serves the store")
        backend = self.metadata.backend
        if backend.lost.is_set():
            raise FencedError(f"{backend.lost_reason}: this broker no longer serves the store")

    def open_partitions(self, topic: TopicRecord, opened: list[SegmentRecord]) -> None:
        self.key_routing.opened(topic)
        self._known[topic.name] = topic
        for seg in opened:
            self._logs[(topic.name, seg.partition)] = PartitionLog(
                # an announced growth's new partitions are written by the new count
                routing=topic.serving if seg.partition >= topic.partitions else topic.partitions,
                topic=topic.name, partition=seg.partition, metadata=self.metadata,
                bookies=self.bookies, choose_ensemble=self.choose_ensemble,
                ack_quorum=self.ack_quorum, on_fenced=self._on_fenced,
                on_sealed=self._on_sealed,
                max_entries=self.config.max_entries_per_segment,
                max_bytes=self.config.max_segment_bytes,
                rollover_ms=self.config.segment_rollover_ms, closing=self.closing,
                tier=self.tier, open_record=seg,
                max_publish_ahead_ms=self.config.max_publish_ahead_ms)

    # -- topics -------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int, *, retention_ms: int | None = None
                     ) -> TopicRecord:
        """Register a topic with its partitions' first segments (one metadata transaction),
        then serve it. A count over ``maxPartitionsPerTopic`` is refused before anything is
        registered; if serving fails, the registration is undone."""
        topic = TopicName.parse(name)
        limit = self.config.max_partitions_per_topic
        if isinstance(partitions, int) and not isinstance(partitions, bool) \
                and partitions > limit:
            raise ConfigError(
                f"invalid partition count {partitions} for topic {str(topic)!r}: this broker "
                f"allows at most {limit} per topic (broker option --max-partitions-per-topic)")
        with self.topics_lock:
            record, opened = self.metadata.create_topic(
                topic, partitions, created_at=now_ms(), retention_ms=retention_ms,
                ensembles=[self.choose_ensemble() for _ in range(partitions)],
                placed=None if self.cluster is None or not isinstance(partitions, int)
                else self.cluster.place(partitions))
            crash_point("topic.registered")
            try:
                self.open_partitions(record, opened)
            except Exception as exc:
                for p in range(partitions):
                    self._logs.pop((record.name, p), None)
                self.metadata.purge_topic(record.name)
                raise StorageError(f"cannot serve new topic {record.name!r}, so it was not "
                                   f"created: {exc}") from None
        return record

    def set_partitions(self, name: str, partitions: int, *, reason: str = "admin"
                       ) -> TopicRecord:
        """Grow a topic to ``partitions`` (``broker/topics/growth.py``)."""
        if self.cluster is not None:  # its partitions gathered here first (cluster_topics.py)
            return self.cluster.topics.grow(name, partitions, reason=reason)
        return self.growth.set_partitions(name, partitions, reason=reason)

    def delete_topic(self, name: str) -> TopicRecord:
        """Delete a topic everywhere: metadata, bookies, the tier and its Iceberg table.

        Crash-safe: the topic is first marked deleted (from then on nobody sees it), then its
        data is removed, then its records; a deletion a crash interrupted is finished when the
        broker starts again (or at its next tier pass).
        """
        topic = TopicName.parse(name)
        with self.topics_lock:
            record = self.metadata.get_topic(topic)  # NotFoundError for an unknown topic
            self.metadata.mark_topic_deleting(record.name, now=now_ms())
            self.key_routing.forget(record.name)
            self._known.pop(record.name, None)
            crash_point("topic.delete-marked")
            for p in range(record.serving):
                plog = self._logs.pop((record.name, p), None)
                if plog is not None:
                    plog.discard()
        self.purge_deleted_topics()
        return record

    def purge_deleted_topics(self) -> None:
        """Remove the data and records of topics marked deleted (idempotent)."""
        for record in self.metadata.topics_being_deleted():
            try:
                purge_topic(record, self.metadata, self.bookies, self.tier,
                            catalog=lambda: self.offloader.catalog,
                            catalog_open=self._offloader is not None)
            except Exception as exc:  # e.g. the tier is unreachable: the next pass finishes it
                report_failure(exc, "could not finish deleting topic %s; will retry", record.name)

    def topic(self, name: str) -> TopicRecord:
        """The topic's record, as the metadata store has it; while that store cannot be
        reached, the last one read here (a Pulsar client connecting meanwhile is answered,
        as its appends are stored, rather than made to wait for the metadata server)."""
        topic = TopicName.parse(name)
        known = self._known.get(str(topic))
        if known is not None and self.metadata.backend.unreachable.is_set():
            return known
        record = self.metadata.get_topic(topic)
        self._known[record.name] = record
        return record

    def topics(self, namespace: str | None = None) -> list[TopicRecord]:
        return self.metadata.list_topics(namespace)

    def appended(self, topic: TopicRecord) -> list[int] | None:
        """Messages appended to each partition of ``topic`` (auto-scaling); on several
        brokers, asked of the broker serving partition 0 alone (``cluster_topics.py``)."""
        if self.cluster is not None:
            return self.cluster.topics.appended(topic)
        return [plog.appended for plog in self.partitions(topic.name)]

    def partition(self, topic: str, partition: int) -> PartitionLog:
        name = str(TopicName.parse(topic))
        plog = self._logs.get((name, partition))
        if plog is None:
            with self.topics_lock:  # a scale event may be opening it
                plog = self._logs.get((name, partition))
        if plog is None:
            record = self.topic(name)  # raises NotFoundError for an unknown topic
            if 0 <= partition < record.serving:  # several brokers: placed here, or elsewhere
                if self.cluster is not None and self.cluster.serve_if_placed(name, partition):
                    return self._logs[(name, partition)]
                raise self.not_served(name, partition)
            raise ConfigError(
                f"invalid partition {partition!r} for topic {name!r}: it has partitions "
                f"0..{record.partitions - 1}"
            )
        return plog

    def partition_count(self, topic: str) -> int:
        return self.topic(topic).partitions

    def all_partitions(self) -> list[PartitionLog]:
        return list(self._logs.values())

    @property
    def data_dir(self) -> Path:
        return Path(self.config.data_dir)

    def partitions(self, topic: str, *, serving: bool = False) -> list[PartitionLog]:
        """The partitions tierstream's readers see; with ``serving``, also those a growth
        announced to the topic's Pulsar clients, which write to them already
        (``broker/topics/growth.py``)."""
        record = self.topic(topic)
        count = record.serving if serving else record.partitions
        logs = [self._logs.get((record.name, p)) for p in range(count)]
        if self.cluster is not None:  # those served here; each other one by its owner
            return [plog for plog in logs if plog is not None]
        if None in logs:  # a scale event is opening the new partitions: wait for it
            with self.topics_lock:
                record = self.topic(topic)
                count = record.serving if serving else record.partitions
                return [self._logs[(record.name, p)] for p in range(count)]
        return logs  # type: ignore[return-value]

    # -- admin views --------------------------------------------------------------------------

    def segments(self, topic: str) -> list[SegmentRecord]:
        return [s for plog in self.partitions(topic) for s in plog.segments()]

    def last_confirmed(self, topic: str) -> dict[int, tuple[Position | None, Position]]:
        logs = self.partitions(topic)
        with self.visibility:
            return {plog.partition: plog.last_confirmed() for plog in logs}

    def ends(self, topic: str) -> dict[int, Position]:
        """Each partition's exclusive end, at one instant: read from memory only, so it is
        answered while the tier is slow or away (:meth:`last_confirmed` may read an index)."""
        logs = self.partitions(topic)
        with self.visibility:
            return {plog.partition: plog.end() for plog in logs}

    def seal(self, topic: str, partition: int | None = None) -> list[SegmentRecord]:
        """Seal the open segment of each partition served here (one named: NotOwnerError if
        another broker owns it)."""
        logs = [p for p in self.partitions(topic) if not p.lost] if partition is None \
            else [self.partition(topic, partition)]
        return [s for s in (plog.seal() for plog in logs) if s is not None]

    def stats(self) -> dict[str, Any]:
        return {
            "topics": len(self.metadata.list_topics()),
            "partitions": len(self._logs),
            "replica_failures": sum(p.replica_failures for p in self._logs.values()),
            "checksum_failures": {b.bookie_id: b.checksum_failures for b in self.bookies.values()},
            "recovered_segments": [r.__dict__ for r in self.recovery],
            "writer_epoch": self.epoch,
            "replication": self.repairer.stats(),
            "bookies": {b.bookie_id: b.state() for b in self.bookies.values()},
        }

    # -- tier -------------------------------------------------------------------------------

    @property
    def offloader(self) -> Offloader:
        """The offloader, created on first use (it opens the Iceberg catalog)."""
        if self._offloader is None:
            self.tier.check()
            catalog = TierCatalog(self.config.catalog, self.tier)
            self._offloader = Offloader(self, self.tier, catalog,
                                        deletion_lag_ms=self.config.deletion_lag_ms)
        return self._offloader

    def tier_pass(self, now: int | None = None) -> dict[str, int]:
        """Apply the offload, bookie-deletion and retention policies once, now."""
        return self.offloader.run_policies(offload_after_ms=self.config.offload_after_ms,
                                           threshold_bytes=self.config.offload_threshold_bytes,
                                           now=now)

    def tier_policies_active(self) -> bool:
        """Whether a tier pass has anything to apply (a policy, or bookie copies to delete)."""
        c = self.config
        return (c.offload_after_ms is not None or c.offload_threshold_bytes is not None
                or any(t.retention_ms is not None for t in self.metadata.list_topics())
                or any(s.tier_url is not None and s.bookie_deleted_at is None
                       for plog in self._logs.values() for s in plog.closed_segments()))

    def set_retention(self, topic: str, retention_ms: int | None) -> TopicRecord:
        name = str(TopicName.parse(topic))
        self.metadata.get_topic(name)
        self.metadata.set_retention(name, retention_ms)
        return self.metadata.get_topic(name)

    # -- lifecycle ----------------------------------------------------------------------------

    def thread_failed(self, what: str) -> Callable[[BaseException], None]:
        """The ``on_error`` of a worker thread the broker cannot serve without: its death
        stops the broker, saying ``what`` failed."""
        def failed(exc: BaseException) -> None:
            if not self.failed.is_set():
                self.failed_reason = f"{what} failed: {exc!r}"
                self.failed.set()
        return failed

    def close(self) -> None:
        """Clean shutdown: seal every open segment, stop the bookies, close the metadata."""
        if self._closed:
            return
        self._closed = True
        self.closing.set()
        self._timer.join()
        self._lease.join()
        if self.cluster is not None:
            self.cluster.stop()
        try:
            if not self.fenced.is_set():  # fenced: what it could still seal is the new one's
                for plog in self._logs.values():
                    with contextlib.suppress(NotOwnerError):  # another's now: it seals it
                        plog.close()
                if self.cluster is not None:  # the others take its partitions at once
                    with contextlib.suppress(UnavailableError):  # else once its lease expired
                        self.owners.release()
        finally:
            for bookie in self.bookies.values():
                bookie.close()
            self.metadata.close()
            unlock_data_dir(self._lock_file)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

