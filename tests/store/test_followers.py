"""Following reads (the tail): caught up, they wait without using the broker's CPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, read
from tierstream.model.positions import Offset

from ..timing import scaled

TOPIC = "acme/web/follow"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.parametrize("how", ["seal", "rollover"])
def test_caught_up_followers_wait_without_cpu_after_a_seal_or_rollover(start_broker, how
                                                                       ) -> None:
    # Regression: a follower caught up at the end of a just-sealed segment, with the next open
    # segment still empty, never waited: the broker spun at ~40% of a core per 4 followers.
    args = ("--max-entries-per-segment", "1") if how == "rollover" else ()
    broker: BrokerProcess = start_broker(*args)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url) as producer:
        producer.send("one")
    readers = [read(TOPIC, broker=broker.url, start=Offset.earliest()) for _ in range(4)]
    got = [next(r).num_rows for r in readers]  # each has caught up with the one message
    assert got == [1, 1, 1, 1]
    if how == "seal":
        with Admin(broker.url) as admin:
            assert len(admin.seal(TOPIC)) == 1
    drained = threading.Event()
    try:
        assert broker.proc is not None
        before = _cpu_seconds(broker.proc.pid)
        drained.wait(2.0)  # a measuring interval: the followers sit idle for two seconds
        used = _cpu_seconds(broker.proc.pid) - before
        assert used < 0.3, f"idle followers used {used:.2f}s of broker CPU in 2s"
        with Producer(TOPIC, broker=broker.url) as producer:
            producer.send("two")
        deadline = time.monotonic() + scaled(30)
        for r in readers:  # and they still see the next message at once
            assert next(r).column("value").to_pylist() == [b"two"]
            assert time.monotonic() < deadline
    finally:
        for r in readers:
            r.close()
