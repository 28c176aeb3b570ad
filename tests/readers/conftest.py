"""The readers' fixtures: a store whose one topic's segments are on S3 (moto)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstream.broker.store import Store

from ..store.test_tier import TOPIC, fill, make_store


@pytest.fixture
def s3_store(data_dir: Path, s3_bucket: str, moto_endpoint: str) -> Iterator[Store]:
    store = make_store(data_dir, tierUrl=f"s3://{s3_bucket}/tier", s3Endpoint=moto_endpoint)
    fill(store, entries=10)
    store.offloader.offload_topic(TOPIC)
    yield store
    store.close()
