"""The second half of a topic's deletion: its data removed, then its records.

``Store.delete_topic`` marks the topic deleted in one metadata transaction (from then on
nobody sees it: crash point ``topic.delete-marked``); :func:`purge_topic` then deletes its
ledgers on every bookie, its tier files and its Iceberg table (``topic.data-deleted``), and
last its metadata records. Each step is idempotent, so a deletion a crash interrupted is
finished by the next broker start or tier pass, whichever broker serves the store then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.metadata.records import TopicRecord
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.tier.catalog import TierCatalog
from tierstream.tier.storage import TierStorage
from tierstream.util.faults import crash_point

__all__ = ["purge_topic"]

log = logging.getLogger(__name__)


def purge_topic(record: TopicRecord, metadata: MetadataStore,
                bookies: Mapping[str, BookieClient], tier: TierStorage, *,
                catalog: Callable[[], TierCatalog], catalog_open: bool) -> None:
    """Remove the data and records of ``record``'s topic, marked deleted. Its Iceberg table
    is dropped through ``catalog()`` when it has tier files, or when the catalog is open
    anyway (``catalog_open``): opening it only to find nothing is not worth it."""
    segments = metadata.segments(record.name)
    for seg in segments:
        for b in seg.ensemble:
            if b in bookies:
                bookies[b].delete_ledger(seg.segment_id)
    tiered = [u for s in segments for u in (s.tier_url, s.offload_pending_url) if u]
    if tiered or catalog_open:
        for url in tiered:
            tier.delete(url)
        tier.delete_topic(TopicName.parse(record.name))
        catalog().drop(TopicName.parse(record.name))
    crash_point("topic.data-deleted")
    metadata.purge_topic(record.name)
    log.info("deleted topic %s (%d segments)", record.name, len(segments))
