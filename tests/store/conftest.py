"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.metadata.store import MetadataStore

from ..network_store import BookieProcess, broker_args


@pytest.fixture(params=["sqlite", "postgresql"])
def metadata_store(request: Any, tmp_path: Path) -> Iterator[MetadataStore]:
    """A new metadata store on each backend: SQLite (the embedded default), PostgreSQL."""
    where: str | Path = tmp_path / "metadata.db" if request.param == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    opened = MetadataStore(where)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def network_store(tmp_path: Path, postgres: Any) -> Iterator[Any]:
    """(metadata URL, three network bookies on loopback, a function making brokers on
    them): a store spread over processes on PostgreSQL."""
    url = postgres.new_database()
    bookies = [BookieProcess(tmp_path / f"bookie-{i}", url, host_label=f"host-{i}").start()
               for i in range(3)]
    brokers: list[BrokerProcess] = []

    def broker(name: str, *extra: str, port: int = 0) -> BrokerProcess:
        proc = BrokerProcess(tmp_path / name, args=broker_args(url, *extra), port=port)
        brokers.append(proc)
        return proc

    yield url, bookies, broker
    for proc in brokers:
        proc.kill()
    for bookie in bookies:
        bookie.kill()
