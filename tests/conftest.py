"""Shared fixtures: real broker processes on loopback, on temporary data directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierstream.store.process import BrokerProcess


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def start_broker(data_dir: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Start ``tierstream broker start`` processes; all are stopped at the end of the test."""
    started: list[BrokerProcess] = []

    def start(*args: str, data: Path | None = None, env: dict[str, str] | None = None
              ) -> BrokerProcess:
        proc = BrokerProcess(data or data_dir, args=list(args), env=env).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def broker(start_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    """One broker with one bookie and default settings."""
    return start_broker()
