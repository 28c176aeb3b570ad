"""A compacted topic's snapshot file (``broker/topics/compaction.py``), read whole: it holds
one row per live key of a partition, so it is as small as the topic's key space."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tierstream.errors import NotFoundError
from tierstream.splits.split import TierLocation
from tierstream.tier.storage import TierStorage

__all__ = ["read_snapshot"]


def read_snapshot(url: str, location: TierLocation) -> pa.Table:
    """The rows of the snapshot at ``url`` (MESSAGE_SCHEMA)."""
    tier = TierStorage(url=url, s3_endpoint=location.s3_endpoint, s3_region=location.s3_region)
    fs = tier.filesystem()
    path = tier.path(url)
    if not fs.exists(path):
        raise NotFoundError(f"the compaction snapshot {url} is gone: the topic was compacted "
                            "twice while this read ran; read again")
    return pq.read_table(path, filesystem=fs)
