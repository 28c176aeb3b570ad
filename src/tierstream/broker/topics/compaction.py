"""Topic compaction: per partition, the latest message of each key up to a horizon, as a
Parquet snapshot on the tier (Pulsar's topic compaction, Kafka's log compaction).

A run of one partition:

1. the horizon is the partition's end as the run starts (exclusive: every message before it);
2. the previous snapshot's rows and the log between its horizon and the new one are folded:
   per key the message with the highest position wins; a winner with an empty value (a
   tombstone, Pulsar's null value) removes its key; messages without a key are not in the
   compacted view (as in Pulsar 3.2+ and Kafka);
3. the rows, in position order and with their original positions, publish times and
   properties, are written to a new file under the topic's tier directory (it appears whole
   or not at all);
4. the partition's ``compactions`` row is replaced in one metadata transaction: readers see
   the old snapshot or the new one;
5. the file two runs old is deleted (the one just replaced stays for readers still on it).

A run killed before step 4 leaves the previous snapshot in force and at most a file nobody
names (the next run of the partition writes a new one); after it, the run is done. Crash
points ``compaction.written`` and ``compaction.saved`` let tests kill it between the steps.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from tierstream.errors import TierstreamError
from tierstream.metadata.compactions import (
    CompactionRecord,
    compaction_thresholds,
    compactions_of,
    save_compaction,
)
from tierstream.model.compacted_view import fold_latest
from tierstream.model.message_format import MESSAGE_SCHEMA
from tierstream.model.names import TopicName
from tierstream.util.faults import crash_point
from tierstream.util.threads import Worker
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.config import StoreConfig
    from tierstream.managed_ledger.partition_log import PartitionLog
    from tierstream.metadata.records import TopicRecord
    from tierstream.metadata.store import MetadataStore
    from tierstream.tier.storage import TierStorage

__all__ = ["CompactionHost", "Compactor", "backlog_bytes"]

log = logging.getLogger(__name__)

#: Pulsar's names for a topic's compaction status (``GET .../compaction``)
NOT_RUN, RUNNING, SUCCESS, ERROR = "NOT_RUN", "RUNNING", "SUCCESS", "ERROR"


class CompactionHost(Protocol):
    """What the compactor uses of the store that runs it (the store implements it)."""

    metadata: MetadataStore
    tier: TierStorage
    config: StoreConfig  # deletion_lag_ms: how long a replaced snapshot stays for readers

    def topic(self, name: str) -> TopicRecord: ...

    def partition(self, topic: str, partition: int) -> PartitionLog: ...

    def partitions(self, topic: str) -> list[PartitionLog]: ...


@dataclass
class _Status:
    state: str = NOT_RUN
    error: str | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    partitions: dict[int, dict[str, Any]] = field(default_factory=dict)


class Compactor:
    """Compaction of the partitions a broker serves, on demand (``topic compact``); one run
    per topic at a time, with its status kept for ``GET .../compaction``."""

    def __init__(self, store: CompactionHost) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._status: dict[str, _Status] = {}
        self._runs: dict[str, Worker] = {}
        self._policy: Worker | None = None

    def status(self, topic: str) -> dict[str, Any]:
        """The topic's last or current run, and each partition's snapshot."""
        name = str(self.store.topic(topic).name)
        with self._lock:
            st = self._status.get(name, _Status())
            out: dict[str, Any] = {"topic": name, "status": st.state, "error": st.error,
                   "started_ms": st.started_ms, "finished_ms": st.finished_ms,
                   "run": dict(st.partitions)}
        snapshots = compactions_of(self.store.metadata, name)
        out["snapshots"] = [r.to_dict() for r in snapshots.values()]
        out["threshold_bytes"] = compaction_thresholds(self.store.metadata).get(name)
        try:
            served = self.store.partitions(name)
        except TierstreamError:
            served = []
        out["backlog_bytes"] = {p.partition: backlog_bytes(p, snapshots.get(p.partition))
                                for p in served}
        return out

    def start(self, topic: str, *, wait: bool,
              progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Compact every partition of ``topic`` served here: now (``wait``), or on a thread
        of its own (the status tells when it is done). A run already going is not doubled."""
        name = str(self.store.topic(topic).name)
        with self._lock:
            running = self._runs.get(name)
            if running is not None and running.alive:
                if not wait:
                    return self.status(name) | {"status": RUNNING}
            else:
                self._status[name] = _Status(state=RUNNING, started_ms=now_ms())
                running = None
        if running is not None:
            running.join()
            return self.status(name)
        if wait:
            self._run(name, progress)
            return self.status(name)
        worker = Worker(f"tierstream-compact {name}", lambda: self._run(name, progress,
                                                                        quiet=True))
        with self._lock:
            self._runs[name] = worker
        worker.start()
        return self.status(name)

    def stop(self) -> None:
        """Stop the threshold policy and wait for the runs going on (the broker stops):
        what a run had not saved is redone by the next one."""
        if self._policy is not None:
            self._policy.stop()
        with self._lock:
            runs = list(self._runs.values())
        for worker in runs:
            worker.join()

    def start_policy(self, interval_s: float) -> None:
        """Look every ``interval_s`` for partitions served here whose topic has a
        compaction threshold and that much written after their horizon; compact them."""
        def run() -> None:
            while not policy.stopping.wait(interval_s):
                try:
                    self.apply_policy()
                except TierstreamError as exc:
                    log.warning("compaction policy: %s; trying again in %.0f s", exc,
                                interval_s)

        policy = self._policy = Worker("tierstream-compaction-policy", run)
        policy.start()

    def apply_policy(self) -> list[str]:
        """Start a run of each topic with a partition over its threshold: their names."""
        started = []
        for topic, threshold in compaction_thresholds(self.store.metadata).items():
            snaps = compactions_of(self.store.metadata, topic)
            try:
                plogs = self.store.partitions(topic)
            except TierstreamError:
                continue  # deleted meanwhile
            if any(backlog_bytes(p, snaps.get(p.partition)) >= threshold for p in plogs):
                with self._lock:
                    running = self._runs.get(topic)
                if running is None or not running.alive:
                    log.info("compacting %s: a partition has %s or more since its horizon",
                             topic, threshold)
                    self.start(topic, wait=False)
                    started.append(topic)
        return started

    def _run(self, topic: str, progress: Callable[[dict[str, Any]], None] | None, *,
             quiet: bool = False) -> None:
        """Compact the topic's partitions; an error is the run's status (and raised unless
        ``quiet``: a run on a thread of its own reports it only there)."""
        try:
            for plog in self.store.partitions(topic):
                done = self.compact_partition(topic, plog.partition)
                with self._lock:
                    self._status[topic].partitions[plog.partition] = done
                if progress is not None:
                    progress(done)
        except TierstreamError as exc:
            self._end(topic, ERROR, str(exc))
            log.warning("compaction of %s failed: %s", topic, exc)
            if not quiet:
                raise
            return
        except Exception as exc:
            self._end(topic, ERROR, f"{type(exc).__name__}: {exc}")
            log.exception("compaction of %s failed", topic)
            if not quiet:
                raise
            return
        self._end(topic, SUCCESS, None)

    def _end(self, topic: str, state: str, error: str | None) -> None:
        with self._lock:
            st = self._status.setdefault(topic, _Status())
            st.state, st.error, st.finished_ms = state, error, now_ms()

    def compact_partition(self, topic: str, partition: int) -> dict[str, Any]:
        """One run of one partition (see the module's docstring): what it did."""
        started = time.monotonic()
        plog = self.store.partition(topic, partition)
        horizon = plog.end()
        previous = compactions_of(self.store.metadata, topic).get(partition)
        if previous is not None and previous.horizon >= horizon:
            return {"partition": partition, "read": 0, "keys": previous.keys,
                    "horizon": previous.to_dict()["horizon"], "unchanged": True}
        parts = []
        if previous is not None and previous.url is not None:
            parts.append(self._snapshot_rows(previous.url))
        start = previous.horizon if previous is not None else plog.earliest()
        read = 0
        for batch in _batches(plog.read(start, end=horizon)):
            parts.append(pa.Table.from_batches([batch]))
            read += batch.num_rows
        rows = pa.concat_tables([p.select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA)
                                 for p in parts]) if parts else MESSAGE_SCHEMA.empty_table()
        latest = fold_latest(rows, in_order=True)  # the snapshot's rows, then the log's
        url = None
        size = 0
        if latest.num_rows:
            tier = self.store.tier
            url = (f"{tier.topic_url(TopicName.parse(topic))}/compacted/partition-{partition}/"
                   f"{horizon.segment_id}-{horizon.entry_id}-{horizon.batch_index}-"
                   f"{uuid.uuid4().hex[:12]}.parquet")
            size = self._write(url, latest)
        crash_point("compaction.written")
        record = CompactionRecord(topic, partition, horizon, url, latest.num_rows, size,
                                  now_ms(), int((time.monotonic() - started) * 1000))
        previous_url = previous.url if previous is not None else None
        save_compaction(self.store.metadata, record)
        crash_point("compaction.saved")
        self._sweep(topic, partition, keep={u for u in (url, previous_url) if u})
        log.info("compacted %s partition %d up to %s: %d key(s) live, %d message(s) read",
                 topic, partition, horizon, latest.num_rows, read)
        return {"partition": partition, "read": read, "keys": latest.num_rows,
                "horizon": record.to_dict()["horizon"], "bytes": size,
                "duration_ms": record.duration_ms}

    def _sweep(self, topic: str, partition: int, keep: set[str]) -> None:
        """Delete the partition's snapshot files no reader is still on: a file other than
        the current and the previous snapshot once the file that replaced it is older than
        the store's deletion lag (a reader plans with a snapshot's URL and reads it later,
        a Spark task maybe much later), and what a killed run left half-written as long
        ago."""
        tier = self.store.tier
        fs = tier.filesystem()
        folder = tier.path(f"{tier.topic_url(TopicName.parse(topic))}/compacted/"
                           f"partition-{partition}")
        try:
            found = sorted((fs.modified(p).timestamp(), p) for p in fs.ls(folder, detail=False))
        except FileNotFoundError:
            return
        kept = {tier.path(u) for u in keep}
        lag_s = self.store.config.deletion_lag_ms / 1000
        now = time.time()
        snapshots = [(t, p) for t, p in found if ".partial-" not in p]
        for t, path in found:
            if path in kept:
                continue
            # a snapshot is replaced when the next one is written; a partial file never is
            replaced = t if ".partial-" in path else \
                min((u for u, _ in snapshots if u > t), default=None)
            if replaced is not None and now - replaced >= lag_s:
                fs.rm(path)
                log.info("removed compaction snapshot file %s of %s/%d", path, topic, partition)

    def _snapshot_rows(self, url: str) -> pa.Table:
        tier = self.store.tier
        return pq.read_table(tier.path(url), filesystem=tier.filesystem())

    def _write(self, url: str, rows: pa.Table) -> int:
        tier = self.store.tier
        fs = tier.filesystem()
        path = tier.path(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        partial = f"{path}.partial-{uuid.uuid4().hex[:8]}"
        pq.write_table(rows, partial, filesystem=fs, compression="zstd")
        fs.mv(partial, path)  # whole or not at all
        return int(fs.size(path))


def backlog_bytes(plog: PartitionLog, snapshot: CompactionRecord | None) -> int:
    """About how many bytes a partition holds after its snapshot's horizon (all of it
    without one): the segments after the horizon's, and of the horizon's own the share of
    its entries after the horizon (counting all of it made a partition of one large segment
    over its threshold at every pass, compacted again and again)."""
    total = 0
    for seg in plog.segments():
        size = int(seg.bytes or 0)
        if snapshot is None or seg.segment_id > snapshot.horizon.segment_id:
            total += size
        elif seg.segment_id == snapshot.horizon.segment_id and seg.entries:
            after = max(0, seg.entries - snapshot.horizon.entry_id)
            total += size * after // seg.entries
    return total


def _batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        if batch.num_rows:
            yield batch

