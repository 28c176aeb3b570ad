"""What every benchmark shares: repeated runs, medians and spread, one table, one JSON file.

A benchmark returns :class:`Figure` rows; :func:`report` prints them as a table (figure, value,
baseline, ratio, aim) and writes ``bench/results/<name>.json`` atomically, so a failed run never
leaves a half-written result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
#: ``python -m bench --tiny``: every benchmark on tiny inputs, one run each, to show that it
#: still runs end to end (the test suite does this for all of them); its figures mean nothing,
#: so its results go to a temporary directory, never to bench/results/.
TINY = False


def use_tiny_profile() -> Path:
    """Switch to the tiny profile; returns the directory its results go to."""
    global RESULTS, TINY
    TINY = True
    RESULTS = Path(tempfile.mkdtemp(prefix="tierstream-bench-tiny-"))
    return RESULTS


def sized(normal: T, tiny: T) -> T:
    """A benchmark's inputs (sizes, runs): ``normal`` (its quick or full profile), or
    ``tiny`` under ``--tiny``."""
    return tiny if TINY else normal
T = TypeVar("T")
console = Console(width=None if os.isatty(1) else 140)


@dataclass
class Figure:
    name: str
    unit: str
    runs: list[float]
    baseline_name: str | None = None
    baseline_runs: list[float] = field(default_factory=list)
    aim: str = ""
    higher_is_better: bool = True
    aim_check: Callable[[float, float | None], bool] | None = None

    @property
    def value(self) -> float:
        return statistics.median(self.runs)

    @property
    def baseline(self) -> float | None:
        return statistics.median(self.baseline_runs) if self.baseline_runs else None

    @property
    def ratio(self) -> float | None:
        b = self.baseline
        return None if not b else self.value / b

    @property
    def met(self) -> bool | None:
        return None if self.aim_check is None else self.aim_check(self.value, self.ratio)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("aim_check")
        out.update(value=self.value, baseline=self.baseline, ratio=self.ratio, met=self.met,
                   spread=_spread(self.runs), baseline_spread=_spread(self.baseline_runs))
        return out


def _spread(runs: list[float]) -> list[float] | None:
    return [min(runs), max(runs)] if runs else None


def repeat(fn: Callable[[], float], runs: int, warmup: int = 1) -> list[float]:
    """Call ``fn`` ``warmup`` times unmeasured, then ``runs`` times (once, no warm-up, under
    ``--tiny``); returns its results."""
    if TINY:
        runs, warmup = 1, 0
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(runs)]


def fill_clicks(store: Any, topic: str, *, partitions: int, entries: int, per_entry: int,
                t0: int, value: Callable[[int, int], bytes], keys: int = 1000,
                segment_entries: int | None = None, seal: bool = True) -> None:
    """Create ``topic`` and append ``entries`` entries of ``per_entry`` messages to each
    partition: message ``n`` of partition ``p`` has value ``value(n, p)``, a key among ``keys``
    users and publish time ``t0 + 10 * n`` ms. A segment is sealed every ``segment_entries``
    entries, and (``seal``) at the end."""
    from tierstream.model.message_format import as_produce_batch

    store.create_topic(topic, partitions)
    for p in range(partitions):
        plog = store.partition(topic, p)
        for e in range(entries):
            if segment_entries and e and e % segment_entries == 0:
                store.seal(topic, p)
            ns = range(e * per_entry, (e + 1) * per_entry)
            plog.append(as_produce_batch(pa.record_batch({
                "key": [f"user-{n * 7919 % keys}" for n in ns],
                "value": [value(n, p) for n in ns],
                "publish_time": [t0 + n * 10 for n in ns]})), producer=None, sequence_id=None)
    if seal:
        store.seal(topic)


#: where free_port looks: below the kernel's ephemeral ports (32768 and up here), which any
#: outgoing connection or listener on port 0 may take between the check and the broker's
#: bind (it did: "port already in use" with the benchmark groups of the suite running at
#: once), and below the block tests/ports.py gives the test workers (20000 and up)
_PORTS = range(10_000, 20_000)
_given: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a listener that 0 would turn off (``--pulsar-port``)."""
    for _ in range(len(_PORTS)):
        port = random.choice(_PORTS)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port left in {_PORTS}")


@contextlib.contextmanager
def broker_with_topic(topic: str, partitions: int) -> Iterator[Any]:
    """A broker process (a ``BrokerProcess``: its ``url``, its ``proc.pid``) on a temporary
    data directory, with ``topic`` created."""
    from tierstream.broker.process import BrokerProcess
    from tierstream.client import Admin

    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data").start()
        try:
            url = broker.url
            assert url is not None
            with Admin(url) as admin:
                admin.create_topic(topic, partitions)
            yield broker
        finally:
            broker.stop()


class WorkerProcess:
    """A benchmark's worker in a process of its own (``python -m MODULE worker ARGS...``): it
    prints ``ready``, acts on the words it is told on stdin (``go``, ``stop``...) and prints
    one JSON line of results before it exits."""

    def __init__(self, module: str, args: list[str], name: str, *,
                 timeout: float = 120.0) -> None:
        self.name, self.timeout = name, timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "worker", *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"consumer {name} did not start: {line!r}")

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.proc.wait(timeout=self.timeout)
        if not line:
            raise RuntimeError(f"consumer {self.name} exited {self.proc.returncode}")
        return dict(json.loads(line))

    @staticmethod
    def drain_results(workers: list[WorkerProcess], word: str = "drained") -> list[dict[str, Any]]:
        """Results of consumers that each stop once idle: the first to report has seen the
        topic go idle, so the rest are told ``word`` — one that never got a message (a shared
        subscription whose other consumers took them all) stops then rather than waiting out
        its wait for a first message."""
        by_fd = {w.proc.stdout.fileno(): w for w in workers if w.proc.stdout is not None}
        with selectors.DefaultSelector() as sel:
            for fd in by_fd:
                sel.register(fd, selectors.EVENT_READ)
            sel.select()
        for w in workers:
            with contextlib.suppress(BrokenPipeError, ValueError):  # it reported and exited
                w.tell(word)
        return [w.result() for w in workers]


def cpu_times(pid: int | None = None) -> tuple[float, float]:
    """CPU seconds used so far by this process, or by process ``pid``: user + system, and
    of it system (in the kernel); one read of the process's accounting."""
    if pid is None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        return used.ru_utime + used.ru_stime, used.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process, or by process ``pid``."""
    return cpu_times(pid)[0]


def thread_switches(pid: int) -> dict[int, int]:
    """Context switches so far of each thread of process ``pid`` (voluntary and not), by
    thread id: the difference of two counts is what the threads alive at the second did in
    between (a thread that ended meanwhile is not in it)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # ended while listed
            lines = (task / "status").read_text().splitlines()
            out[int(task.name)] = sum(int(line.split()[1]) for line in lines
                                      if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
    return out


def switches_between(before: dict[int, int], after: dict[int, int]) -> int:
    """Context switches between two :func:`thread_switches` counts."""
    return sum(n - before.get(tid, 0) for tid, n in after.items())


class ProcessCpu:
    """CPU seconds (user + system) this process (``client``) and process ``pid`` (``broker``;
    with several, the brokers of a cluster, their sum) spend between entering and leaving: a
    message's cost, which does not move with the machine's load as its throughput does."""

    def __init__(self, pid: int, *more: int) -> None:
        self.pids = (pid, *more)
        self.client = self.broker = self.broker_system = 0.0

    def _brokers(self) -> tuple[float, float]:
        times = [cpu_times(pid) for pid in self.pids]
        return sum(t[0] for t in times), sum(t[1] for t in times)

    def __enter__(self) -> ProcessCpu:
        self._start = (cpu_seconds(), *self._brokers())
        return self

    def __exit__(self, *exc: object) -> None:
        client, (broker, system) = cpu_seconds(), self._brokers()
        self.client = client - self._start[0]
        self.broker = broker - self._start[1]
        self.broker_system = system - self._start[2]


def _reference_loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def loop_unit_us() -> float:
    """µs of one iteration of a fixed pure-Python loop (``total += i * i % 7``), the fastest
    of 5 timings of 200,000 iterations in this run: CPU figures divided by it ("loop units")
    compare across machines, as Python's own speed on each is the yardstick."""
    return min(timed(lambda: _reference_loop(200_000)) for _ in range(5)) / 200_000 * 1e6


def cost_figures(what: str, messages: int, used: list[ProcessCpu], unit_us: float, *,
                 baseline: tuple[str, list[ProcessCpu]] | None = None,
                 server: str = "broker") -> list[Figure]:
    """The broker's (``server``: what the other process is) and the client's CPU per message
    of ``used`` runs (µs, and in loop units of ``unit_us``: see :func:`loop_unit_us`), beside
    ``baseline``'s where given."""
    out = []
    for side, name in (("broker", server), ("client", "client")):
        out += own_cost_figures(
            f"{what}: {name}", messages, [getattr(c, side) for c in used], unit_us,
            baseline=None if baseline is None else (
                baseline[0], [getattr(c, side) for c in baseline[1]]))
    # the kernel's part of the server's figure (system calls, fsync, waking threads): what
    # no cut of Python or pyarrow work per message moves
    out.insert(2, Figure(
        f"{what}: {server} CPU per message, of it in the kernel", "us",
        [c.broker_system / messages * 1e6 for c in used],
        None if baseline is None else f"{baseline[0]}, in the kernel",
        [] if baseline is None else [c.broker_system / messages * 1e6 for c in baseline[1]],
        higher_is_better=False))
    return out


def own_cost_figures(what: str, messages: int, seconds: list[float], unit_us: float, *,
                     baseline: tuple[str, list[float]] | None = None) -> list[Figure]:
    """CPU per message of runs that used ``seconds`` of CPU each, in µs and in loop units of
    ``unit_us``, beside ``baseline``'s runs where given."""
    us = [s / messages * 1e6 for s in seconds]
    base_name, base = (None, []) if baseline is None else (
        baseline[0], [s / messages * 1e6 for s in baseline[1]])
    return [Figure(f"{what} CPU per message", "us", us, base_name, base,
                   higher_is_better=False),
            Figure(f"{what} CPU per message, in loop units", "loops",
                   [u / unit_us for u in us], base_name, [b / unit_us for b in base],
                   higher_is_better=False)]


def cpu_of(fn: Callable[[], Any]) -> tuple[float, float]:
    """Seconds ``fn`` took, and the CPU seconds (user + system, every thread) this process
    spent meanwhile."""
    before = cpu_seconds()
    seconds = timed(fn)
    return seconds, cpu_seconds() - before


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        s = f"{x:,.0f}"
    elif abs(x) >= 1:
        s = f"{x:,.2f}"
    else:
        s = f"{x:.3f}"
    return f"{s} {unit}".strip()


def report(name: str, figures: list[Figure], params: dict[str, Any],
           extra: dict[str, Any] | None = None) -> Path:
    table = Table("figure", "value", "spread", "baseline", "ratio", "aim", "met", title=name)
    for f in figures:
        spread = _spread(f.runs)
        table.add_row(
            f.name, _fmt(f.value, f.unit),
            "-" if spread is None else f"{_fmt(spread[0])}..{_fmt(spread[1])}",
            "-" if f.baseline is None else f"{_fmt(f.baseline, f.unit)} ({f.baseline_name})",
            "-" if f.ratio is None else f"{f.ratio:.2f}",
            f.aim or "-",
            {None: "-", True: "yes", False: "NO"}[f.met],
        )
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        "versions": _versions(),
        "parameters": params,
        "figures": [f.to_dict() for f in figures],
        **(extra or {}),
    }
    path = RESULTS / f"{name}.json"
    fd, tmp = tempfile.mkstemp(dir=RESULTS, prefix=f".{name}.", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, indent=2)
    os.replace(tmp, path)
    console.print(f"results: {path}")
    return path


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("tierstream", "pyarrow", "pyspark", "pyiceberg"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "-"
    return out


def save_chart(name: str, draw: Callable[[Any], None]) -> Path:
    """Draw with matplotlib (Agg) into ``bench/results/<name>.png``, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    tmp = RESULTS / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    console.print(f"chart: {path}")
    return path
