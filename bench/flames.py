"""``python -m bench NAME... --flame``: where the broker's CPU goes on a hot path, as a flame
graph per path (``bench/results/flame-<path>.svg``), to read before changing anything.

The broker runs natively; py-spy samples it while the path's messages go through, once warm.
``--gil`` keeps only the samples in which a broker thread holds the GIL, that is, is running
Python (or C called from Python without releasing it): waits on sockets, fsync and locks,
which an ordinary sample counts as time, are left out, so the widths are CPU. Threads that
gRPC or the bookies start in C appear under the Python frames they call. py-spy reads the
broker's memory with ptrace: it needs root (as here) or ``kernel.yama.ptrace_scope`` 0.

The same paths as ``--instructions`` (``bench/instructions.py``), with more messages, so that
each graph holds a few thousand samples: about 30 s for all four.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import console, free_port, sized
from bench.instructions import (
    PATHS,
    _own_consume,
    _own_produce,
    _pulsar_consume,
    _pulsar_produce,
    _topic,
)
from tierstream.broker.process import BrokerProcess

__all__ = ["PATHS", "flames"]

#: samples per second (of the thread holding the GIL: most samples find none)
RATE = 1000


class _Broker:
    """A broker process with a Pulsar listener, for the workloads of instructions.py."""

    def __init__(self, tmp: Path) -> None:
        port = free_port()
        self.proc = BrokerProcess(tmp / "data", args=["--pulsar-port", str(port)]).start()
        assert self.proc.url is not None and self.proc.pulsar_url is not None
        self.url, self.pulsar_url = self.proc.url, self.proc.pulsar_url

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid


def _py_spy() -> str:
    """The py-spy beside this interpreter (the project's environment has it), or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--flame needs py-spy (make install puts it in the project's "
                           "environment; or pip install py-spy)")
    return found


def _sampled(spy_path: str, broker: _Broker, out: Path, work: Callable[[int], Any],
             seconds: float) -> None:
    """:func:`_sample_once`; again, for twice as long, while py-spy sampled nothing (on a
    loaded machine it can attach only after a short run's work is over)."""
    for attempt in range(3):
        if _sample_once(spy_path, broker, out, work, seconds * 2 ** attempt):
            return
    raise RuntimeError(f"py-spy sampled nothing of the broker in 3 tries ({seconds * 4:g} s "
                       "the last): the machine may be too busy for it to attach in time")


def _sample_once(spy_path: str, broker: _Broker, out: Path, work: Callable[[int], Any],
                 seconds: float) -> bool:
    """Run ``work(1)``, ``work(2)``... for at least ``seconds``, with py-spy sampling the
    broker into ``out``; False if py-spy, stopped by us, had no sample to write."""
    out.unlink(missing_ok=True)  # (one of an earlier run is not this one's)
    spy = subprocess.Popen(
        [spy_path, "record", "--gil", "--rate", str(RATE), "--format", "flamegraph",
         "--output", str(out), "--pid", str(broker.pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # attached before the work starts
        if spy.poll() is not None:
            raise RuntimeError(f"py-spy could not sample the broker: {spy.stderr.read()}")
        started, i = time.monotonic(), 1
        while True:
            work(i)
            if time.monotonic() - started >= seconds:
                break
            i += 1
    finally:
        ended = spy.poll() is not None  # on its own, before it was told: it failed
        spy.send_signal(signal.SIGINT)  # it writes the graph of what it sampled, then exits
        _, err = spy.communicate(timeout=120)
    if out.exists():
        return True
    if ended:
        raise RuntimeError(f"py-spy wrote no flame graph ({spy.returncode}): {err[-2000:]}")
    return False  # it ran until told to stop, and had nothing to write


def flames(names: list[str], quick: bool = True) -> list[Path]:
    """A flame graph of the broker's CPU on each path in ``names`` (``PATHS``)."""
    spy = _py_spy()
    # each path's work again and again for this long: a few thousand samples at RATE
    messages, seconds = sized((200_000, 5.0) if quick else (1_000_000, 20.0), (4_000, 2.0))
    written: list[Path] = []
    harness.RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        broker = _Broker(Path(tmp))
        try:
            produced = _topic(broker, "flame-produce")
            consumed = _topic(broker, "flame-consume")
            _own_produce(broker, consumed, messages)
            works: dict[str, Callable[[int], Any]] = {
                "produce": lambda i: _own_produce(broker, produced, messages),
                # an exclusive subscription's receive + ack: the path a consumer takes (a
                # plain read through the broker costs a sixth of it: --instructions)
                "consume": lambda i: _own_consume(broker, consumed, f"own-{i}", messages),
                "pulsar-produce": lambda i: _pulsar_produce(
                    broker, produced, messages),
                "pulsar-consume": lambda i: _pulsar_consume(
                    broker, consumed, f"pulsar-{i}", messages),
            }
            for name in names:
                works[name](0)  # warm
                out = harness.RESULTS / f"flame-{name}.svg"
                _sampled(spy, broker, out, works[name], seconds)
                console.print(f"flame graph of the broker, {name}: {out}")
                written.append(out)
        finally:
            broker.proc.stop()
    return written

