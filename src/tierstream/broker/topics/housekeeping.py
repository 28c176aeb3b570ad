"""The store's periodic work, on one thread (``store-housekeeping``): each partition's
rollover by age, a segment blocked by an undecided transaction, live stats; then
re-replication, announced growths, auto-scaling, expired transactions, and the tier pass
(deleted topics purged, offload, bookie copies deleted, retention). A step that fails is
said and tried again at the next pass: housekeeping never stops the broker."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from tierstream.errors import UnavailableError
from tierstream.util.faults import fault_point
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.config import StoreConfig
    from tierstream.broker.topics.auto_scale import AutoScaler
    from tierstream.broker.topics.growth import Growth
    from tierstream.broker.transactions.coordinator import TransactionCoordinator
    from tierstream.managed_ledger.bookies.repair import Repairer
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["Housekept", "report_failure", "run_housekeeping"]

log = logging.getLogger(__name__)


class Housekept(Protocol):
    """What housekeeping uses of the store (the store implements it)."""

    closing: threading.Event
    config: StoreConfig
    repairer: Repairer
    growth: Growth
    transactions: TransactionCoordinator
    auto_scale: AutoScaler | None

    def all_partitions(self) -> list[PartitionLog]: ...

    def purge_deleted_topics(self) -> None: ...

    def tier_policies_active(self) -> bool: ...

    def tier_pass(self, now: int | None = None) -> dict[str, int]: ...


def run_housekeeping(store: Housekept) -> None:
    """Pass after pass until the store closes; the transaction and tier passes at their own
    intervals (the first of each waits one)."""
    config = store.config
    interval = min(1.0, config.segment_rollover_ms / 4000, config.tier_check_interval_ms / 1000)
    last_txn_pass = last_tier_pass = time.monotonic()
    while not store.closing.wait(interval):
        fault_point("store.housekeeping")
        for plog in store.all_partitions():
            try:
                plog.roll_if_aged()
                plog.roll_if_blocked(config.transaction_hold_limit_ms)
                plog.flush_stats()
            except Exception as exc:  # keep housekeeping alive; log and go on
                report_failure(exc, "housekeeping failed for %s/%s", plog.topic,
                               plog.partition)
        try:
            store.repairer.run_once()
        except Exception as exc:
            report_failure(exc, "re-replication failed; retrying at the next pass")
        try:
            store.growth.record_due(now_ms())
        except Exception as exc:
            report_failure(exc, "recording an announced growth failed; retrying at the next "
                           "pass")
        now = time.monotonic()
        if store.auto_scale is not None:
            try:
                store.auto_scale.check(now)
            except Exception as exc:
                report_failure(exc, "auto-scaling failed; retrying at the next pass")
        if now - last_txn_pass >= min(10.0, config.transaction_timeout_ms / 4000):
            last_txn_pass = now
            try:
                store.transactions.expire()
            except Exception as exc:
                report_failure(exc, "transaction housekeeping failed; retrying later")
        if now - last_tier_pass >= config.tier_check_interval_ms / 1000:
            last_tier_pass = now
            try:
                store.purge_deleted_topics()
                if store.tier_policies_active():
                    counts = store.tier_pass()
                    if any(counts.values()):
                        log.info("tier pass: %s", counts)
            except Exception as exc:  # a tier outage must not stop the broker; say so, retry
                report_failure(exc, "tier pass failed; segments stay readable from bookies")


def report_failure(exc: Exception, message: str, *args: Any) -> None:
    """A background step failed: one line when the metadata's server is unreachable (an
    outage, said once more by the backend), the stack for anything else (a bug to report)."""
    if isinstance(exc, UnavailableError):
        log.warning(message + ": %s", *args, exc)
    else:
        log.exception(message, *args)
