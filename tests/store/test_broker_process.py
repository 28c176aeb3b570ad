"""Starting a broker as a child process (``BrokerProcess``, which the tests, the bench and
the tour use) from a process full of threads and native libraries."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa

from tierstream.broker.process import BrokerProcess
from tierstream.broker.run import SHUTDOWN_GRACE_S
from tierstream.client import Admin, Producer
from tierstream.client.transaction import Transaction

from ..timing import scaled
from .helpers import read_all

#: Set while the test below runs: the at-fork handler then hangs the forked child, as the
#: handler of a native library (gRPC's, the Pulsar client's) can when another of its threads
#: held a lock at the fork
_HANG_IN_CHILD = threading.Event()


def _at_fork_in_child() -> None:
    if _HANG_IN_CHILD.is_set():
        time.sleep(3600)


os.register_at_fork(after_in_child=_at_fork_in_child)


def test_a_broker_starts_from_a_process_whose_libraries_hang_a_forked_child(
        data_dir: Path) -> None:
    """Regression: a broker restarted beside the real Pulsar client's threads hung its test
    for 600 s (a fresh clone's run): the child was forked to run a preexec_fn, ran the
    at-fork handlers of the libraries loaded in the test process, and never reached exec.
    A broker is now spawned (no preexec_fn; a file limit is set by ``prlimit``), which runs
    no at-fork handler."""
    started: list[BrokerProcess] = []
    _HANG_IN_CHILD.set()
    try:
        starting = threading.Thread(target=lambda: started.append(
            BrokerProcess(data_dir, open_files=256).start()), daemon=True)
        starting.start()
        starting.join(scaled(60))
    finally:
        _HANG_IN_CHILD.clear()
        if not started:
            _kill_forked_children()
    assert started, "starting a broker hung in a forked child that never exec'd"
    broker = started[0]
    try:
        limits = Path(f"/proc/{broker.proc.pid}/limits").read_text()  # type: ignore[union-attr]
        assert any(line.startswith("Max open files") and line.split()[3:5] == ["256", "256"]
                   for line in limits.splitlines()), limits
    finally:
        broker.stop()


def test_a_broker_stops_on_sigterm_while_clients_hold_idle_streams(data_dir: Path) -> None:
    """Regression: a broker asked to stop while a producer and a transaction held their
    streams open, sending nothing, waited for them for good (Flight's shutdown waits for
    every call under way, and an idle stream ends only when its client closes it): a
    zombie broker of a cluster never exited. It waits ``SHUTDOWN_GRACE_S`` now, says so,
    and exits cleanly; what was acknowledged is there after a restart."""
    topic = "acme/web/idle"
    with BrokerProcess(data_dir) as broker:
        with Admin(broker.url) as admin:
            admin.create_topic(topic, 1)
        producer = Producer(topic, broker=broker.url)
        txn = Transaction(broker=broker.url)
        try:
            producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(10))
            producer.flush()  # acknowledged; its stream stays open
            txn.write(topic, pa.table({"key": ["k"], "value": [b"staged"]}))
            txn.flush()  # staged; its stream stays open too
            began = time.monotonic()
            assert broker.stop(timeout=scaled(SHUTDOWN_GRACE_S + 30)) == 0
            assert time.monotonic() - began >= SHUTDOWN_GRACE_S * 0.9  # it waited for them
        finally:
            producer.close()
            txn.close()
        said = "".join(broker.stderr_tail)
        assert "clients' streams left open" in said and "Traceback" not in said, said[-3000:]
    with BrokerProcess(data_dir) as again:
        assert read_all(again.url, topic).num_rows == 10


def _kill_forked_children() -> None:
    """The children of this process that were forked and never exec'd (they run this
    process's own command line): the old code's hung ones."""
    own = Path("/proc/self/cmdline").read_bytes()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == os.getpid() and (entry / "cmdline").read_bytes() == own:
                os.kill(int(entry.name), signal.SIGKILL)
