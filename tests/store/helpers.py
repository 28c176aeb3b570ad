"""Helpers for store tests: reading everything back and waiting on conditions with deadlines."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from tierstream.client import read
from tierstream.model.positions import Offset

from ..timing import scaled


def read_all(url: str, topic: str, **kwargs: Any) -> pa.Table:
    """Every message of ``topic`` up to the latest confirmed one, partition by partition."""
    batches = list(read(topic, broker=url, end=Offset.latest(), **kwargs))
    if not batches:
        from tierstream.model.message_format import MESSAGE_SCHEMA

        return MESSAGE_SCHEMA.empty_table()
    return pa.Table.from_batches(batches)


def wait_for(condition: Callable[[], bool], timeout: float | None = None,
             what: str = "condition") -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds (default
    ``scaled(30)``; callers pass scaled deadlines too: tests/timing.py)."""
    timeout = scaled(30) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)  # a poll interval, not synchronisation: the condition decides


def positions(table: pa.Table) -> list[tuple[int, int, int, int]]:
    cols = [table.column(c).to_pylist() for c in
            ("partition", "segment_id", "entry_id", "batch_index")]
    return list(zip(*cols, strict=True))


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (``kill`` returns once
    the signal is queued, not once the process stopped)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:  # the state follows the command, which may hold spaces and parentheses
                states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended
        return all(state in ("T", "t") for state in states)

    wait_for(stopped, scaled(10), f"process {pid} stopped")
