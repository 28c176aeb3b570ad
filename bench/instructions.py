"""``python -m bench NAME... --instructions``: the broker's instructions per message on a hot
path, counted by valgrind's callgrind — the cost figure that does not move with the machine's
load, as CPU seconds do (±40 % between quick runs on a busy 2-core machine).

One broker runs under ``valgrind --tool=callgrind --instr-atstart=no``: it starts uninstrumented
(about 5x slower than natively, ~6 s here) and counts nothing until a measured window, which
``callgrind_control -i on`` opens and ``-i off`` then ``--dump`` close. Each path's messages are
sent or read once uncounted (warm-up: imports, first allocations), then counted in ``runs``
windows; inside one the broker runs 30-50x slower than natively, which the figure does not see.
A window counts every thread of the broker (gRPC's, the Pulsar listener's, the dispatchers')
and nothing of the client, which runs natively in this process. ``PYTHONHASHSEED=0``: set
iteration orders, so that two windows of the same work count within a fraction of a percent.

The real Pulsar client's paths are measured beside tierstream's own client doing the same work
in the same broker (the cost table's "within 1.2x" goal). ``python -m bench produce consume
pulsar-produce pulsar-consume --instructions`` takes about a minute and a half. With
``--against REV`` the same windows are counted again at REV, by a second process with REV's
``src`` first on its path (REV's broker and clients), beside this tree's.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import pulsar
import pyarrow as pa

import tierstream
from bench.harness import Figure, console, free_port, report, sized
from bench.transport_floor import FloorProcess
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer, read
from tierstream.model.message_format import as_produce_batch
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol.columns import properties_column
from tierstream.pulsar_protocol.messages import PUBLISH_TIME, SEQUENCE_ID

VALUE = b"v" * 100
BATCH = 1000
#: the goal for the real client's paths: what tierstream's own client costs the broker, x 1.2
WITHIN: dict[str, Any] = {"higher_is_better": False, "aim": "ratio <= 1.2",
                          "aim_check": lambda value, ratio: ratio is not None and ratio <= 1.2}


class Served(Protocol):
    """A broker the workloads below talk to: its Flight and Pulsar addresses."""

    @property
    def url(self) -> str: ...

    @property
    def pulsar_url(self) -> str: ...


def _callgrind(dumps: Path) -> list[str]:
    """The command prefix that runs a process under callgrind, counting nothing until told."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("--instructions needs valgrind (callgrind and callgrind_control "
                           "on PATH): apt-get install valgrind")
    dumps.mkdir()
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
            f"--callgrind-out-file={dumps}/callgrind.out.%p"]


class _Counted:
    """A process under callgrind (``pid``, writing into ``dumps``), counting only inside
    :meth:`window`."""

    dumps: Path

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def _control(self, *args: str) -> None:
        done = subprocess.run(["callgrind_control", *args, str(self.pid)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or "OK" not in done.stdout:
            raise RuntimeError(f"callgrind_control {' '.join(args)}: {done.stdout}{done.stderr}")

    @contextmanager
    def window(self, counted: list[int]) -> Iterator[None]:
        """Count the broker's instructions (callgrind's Ir) while the block runs; append them
        to ``counted``."""
        before = set(self.dumps.iterdir())
        self._control("-i", "on")
        try:
            yield
        finally:
            self._control("-i", "off")
        self._control("--dump")
        new = sorted(set(self.dumps.iterdir()) - before, key=lambda p: p.stat().st_mtime_ns)
        if not new:
            raise RuntimeError("callgrind wrote no dump for the window")
        totals = [line for line in new[-1].read_text().splitlines()
                  if line.startswith("totals:")]
        counted.append(int(totals[0].split()[1]))


class CountedBroker(_Counted):
    """A broker process under callgrind."""

    def __init__(self, tmp: Path) -> None:
        self.dumps = tmp / "callgrind"
        prefix = _callgrind(self.dumps)
        self.proc = BrokerProcess(tmp / "data", env={"PYTHONHASHSEED": "0"},
                                  args=["--pulsar-port", str(free_port())], prefix=prefix)

    def __enter__(self) -> CountedBroker:
        self.proc.start(timeout=600)  # valgrind's start, then the broker's imports, 5x slower
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(timeout=600)

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    @property
    def url(self) -> str:
        assert self.proc.url is not None
        return self.proc.url

    @property
    def pulsar_url(self) -> str:
        assert self.proc.pulsar_url is not None
        return self.proc.pulsar_url


class CountedFloor(FloorProcess, _Counted):
    """The bare Flight server of ``bench/transport_floor.py`` under callgrind, serving
    ``messages`` on each DoGet."""

    def __init__(self, tmp: Path, messages: int) -> None:
        self.dumps = tmp / "callgrind-floor"
        super().__init__(messages, batch=BATCH, value_bytes=len(VALUE),
                         prefix=_callgrind(self.dumps))

    def __enter__(self) -> CountedFloor:
        super().__enter__()
        return self


def _topic(broker: Served, name: str) -> str:
    topic = f"bench/instructions/{name}"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    return topic


def _own_produce(broker: Served, topic: str, messages: int) -> None:
    batch = pa.record_batch({"value": [VALUE] * BATCH})
    with Producer(topic, broker=broker.url, batch_size=BATCH, max_in_flight=16) as producer:
        for _ in range(messages // BATCH):
            producer.send_batch(batch, partition=0)
        producer.flush()


def _own_produce_as_pulsar(broker: Served, topic: str, messages: int) -> None:
    """:func:`_own_produce` of the rows a Pulsar client's messages are stored as: each with
    its ``pulsar.sequence_id`` and the batch's ``pulsar.publish_time`` properties."""
    publish = [(PUBLISH_TIME, str(int(time.time() * 1000)))]
    with Producer(topic, broker=broker.url, batch_size=BATCH, max_in_flight=16) as producer:
        for first in range(0, messages, BATCH):
            producer.send_batch(pa.record_batch({
                "value": pa.array([VALUE] * BATCH),
                "properties": properties_column(range(first, first + BATCH), SEQUENCE_ID,
                                                publish)}), partition=0)
        producer.flush()


def _pulsar_produce(broker: Served, topic: str, messages: int) -> None:
    client = pulsar.Client(broker.pulsar_url,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        producer = client.create_producer(
            f"persistent://{topic}", batching_enabled=True, batching_max_messages=BATCH,
            batching_max_allowed_size_in_bytes=4 << 20, batching_max_publish_delay_ms=100,
            max_pending_messages=20 * BATCH, block_if_queue_full=True)
        for _ in range(messages):
            producer.send_async(VALUE, None)
        producer.flush()
        producer.close()
    finally:
        client.close()


def _own_consume(broker: Served, topic: str, subscription: str, messages: int
                 ) -> None:
    got = 0
    with Consumer(topic, subscription, mode="exclusive", broker=broker.url,
                  initial=Offset.earliest()) as consumer:
        while got < messages:
            batch = consumer.receive(timeout=600)
            if batch is None:
                raise RuntimeError(f"{subscription}: {got} of {messages} messages received")
            consumer.ack(batch)
            got += batch.num_rows


def _pulsar_consume(broker: Served, topic: str, subscription: str, messages: int
                    ) -> None:
    client = pulsar.Client(broker.pulsar_url,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        consumer = client.subscribe(
            f"persistent://{topic}", subscription, consumer_type=pulsar.ConsumerType.Exclusive,
            initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=BATCH)
        for _ in range(messages):
            consumer.acknowledge(consumer.receive(timeout_millis=600_000))
        consumer.close()  # sends the acks still grouped: inside the window
    finally:
        client.close()


def _read(broker: Served, topic: str, messages: int) -> None:
    got = sum(b.num_rows for b in read(topic, broker=broker.url, end=Offset.latest()))
    if got != messages:
        raise RuntimeError(f"read {got} of {messages} messages")


def _counted(broker: _Counted, runs: int, work: Callable[[int], None]) -> list[int]:
    """Instructions of ``work(i)`` in ``runs`` windows after one uncounted call."""
    work(0)
    counted: list[int] = []
    for i in range(1, runs + 1):
        with broker.window(counted):
            work(i)
    return counted


#: what each path's counted figure is called (the keys of :func:`_count`'s answer)
LABELS = {
    "own-produce": "produce, 1 partition, batches of 1,000 (tierstream's Producer)",
    "pulsar-produce": "real pulsar-client produce",
    "as-pulsar": "tierstream's Producer sending the rows a Pulsar message is stored as",
    "read": "consume through the broker (read)",
    "own-consume": "exclusive subscription, receive + ack (tierstream's Consumer)",
    "pulsar-consume": "real pulsar-client exclusive receive + ack",
}


def _count(names: list[str], messages: int, runs: int) -> dict[str, list[float]]:
    """The broker's instructions per message on the paths ``names`` need (LABELS' keys),
    one broker under callgrind for all."""
    counts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, CountedBroker(Path(tmp)) as broker:
        console.print(f"broker under callgrind: {broker.url} (tierstream of "
                      f"{Path(tierstream.__file__).parent.parent})")

        def per_message(counted: list[int]) -> list[float]:
            return [c / messages for c in counted]

        def produced(kind: str, send: Callable[[CountedBroker, str, int], None]
                     ) -> list[float]:
            topic = _topic(broker, f"produce-{kind}")
            return per_message(_counted(broker, runs, lambda _: send(broker, topic, messages)))

        def consumed(kind: str, topic: str,
                     receive: Callable[[CountedBroker, str, str, int], None]) -> list[float]:
            return per_message(_counted(
                broker, runs, lambda i: receive(broker, topic, f"{kind}-{i}", messages)))

        counts["own-produce"] = produced("own", _own_produce)
        if "pulsar-produce" in names:
            counts["pulsar-produce"] = produced("pulsar", _pulsar_produce)
            counts["as-pulsar"] = produced("as-pulsar", _own_produce_as_pulsar)
        if "consume" in names or "pulsar-consume" in names:
            topic = _topic(broker, "consume")  # what each window reads whole, from the start
            _own_produce(broker, topic, messages)
            counts["own-consume"] = consumed("own", topic, _own_consume)
        if "consume" in names:
            counts["read"] = per_message(_counted(
                broker, runs, lambda _: _read(broker, topic, messages)))
        if "pulsar-consume" in names:
            counts["pulsar-consume"] = consumed("pulsar", topic, _pulsar_consume)
    return counts


def instructions(names: list[str], quick: bool = True, against: str | None = None) -> Path:
    """The broker's instructions per message on each path in ``names`` (PATHS); with
    ``against``, the same counted on that git revision's broker code beside them."""
    messages, runs = sized((20_000, 3) if quick else (100_000, 5), (2_000, 1))
    if against is not None:
        return _against(names, messages, runs, against)
    counts = _count(names, messages, runs)
    own_produce = counts["own-produce"]
    figures: list[Figure] = []
    if "produce" in names:
        figures.append(Figure("produce, 1 partition, batches of 1,000: broker "
                              "instructions per message", "instr", own_produce,
                              higher_is_better=False))
    if "pulsar-produce" in names:
        figures.append(Figure("real pulsar-client produce: broker instructions per "
                              "message", "instr", counts["pulsar-produce"],
                              "tierstream's Producer", own_produce, **WITHIN))
        # the same rows stored: what a Pulsar message carries beside its value costs every
        # client; the rest is the protocol's (frames, the batch's split)
        figures.append(Figure(
            "  the same, beside tierstream's Producer sending the rows a Pulsar message "
            "is stored as (its pulsar.* properties)", "instr", counts["pulsar-produce"],
            "tierstream's Producer, same rows", counts["as-pulsar"], higher_is_better=False))
    if "consume" in names:
        figures += [
            Figure("consume through the broker (read): broker instructions per message",
                   "instr", counts["read"], higher_is_better=False),
            Figure("exclusive subscription, receive + ack: broker instructions per "
                   "message", "instr", counts["own-consume"], higher_is_better=False)]
    if "pulsar-consume" in names:
        figures.append(Figure("real pulsar-client exclusive receive + ack: broker "
                              "instructions per message", "instr", counts["pulsar-consume"],
                              "tierstream's Consumer", counts["own-consume"], **WITHIN))
    if "produce" in names or "consume" in names:
        figures += _floors(names, messages, runs, own_produce,
                           counts["own-consume"] if "consume" in names else [])
    _print(figures)
    return report("instructions", figures, {"messages": messages, "runs": runs,
                                            "paths": names, "value_bytes": len(VALUE),
                                            "batch": BATCH})


def _against(names: list[str], messages: int, runs: int, rev: str) -> Path:
    """Every path's count on this tree, then at ``rev``: its ``src`` (``git archive``) first
    on the path of a second counting process, so that the broker and the clients are
    ``rev``'s (a client speaks its own revision's protocol) and the counting is this
    tree's. A ratio under 1 is a cut."""
    from bench.history import ROOT, tree_at

    with tempfile.TemporaryDirectory() as tmp:
        old = tree_at(rev, Path(tmp) / "old") / "src"  # first: a bad REV fails at once
        now = _count(names, messages, runs)
        out = Path(tmp) / "counts.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old), str(ROOT)])}
        done = subprocess.run([sys.executable, "-m", "bench.instructions", str(out),
                               str(messages), str(runs), *names],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise RuntimeError(f"counting at {rev} failed: {last}")
        console.print(done.stdout.strip())
        then = json.loads(out.read_text())
    figures = [Figure(f"{LABELS[key]}: broker instructions per message, this tree", "instr",
                      runs_now, f"the same at {rev}", then[key], higher_is_better=False)
               for key, runs_now in now.items() if key in then]
    _print(figures)
    return report(f"instructions-against-{rev}", figures,
                  {"messages": messages, "runs": runs, "paths": names, "revision": rev,
                   "value_bytes": len(VALUE), "batch": BATCH})


def _print(figures: list[Figure]) -> None:
    for f in figures:
        spread = (max(f.runs) - min(f.runs)) / statistics.median(f.runs) if f.runs else 0.0
        console.print(f"{f.name}: {f.value:,.0f} (windows within {spread:.1%})"
                      + ("" if f.ratio is None else f", {f.ratio:.2f} x {f.baseline_name}"))


def _floors(names: list[str], messages: int, runs: int, own_produce: list[float],
            own_consume: list[float]) -> list[Figure]:
    """The transport's own instructions per message on the produce and consume paths (a
    bare Flight server doing the same exchanges: bench/transport_floor.py), beside the
    broker's: the part of the broker's figure no change to tierstream's code can remove."""
    from bench.transport_floor import floor_consume, floor_produce

    figures = []
    batch = as_produce_batch(pa.record_batch({"value": [VALUE] * BATCH}))
    with tempfile.TemporaryDirectory() as tmp, CountedFloor(Path(tmp), messages) as floor:
        if "produce" in names:
            runs_in = _counted(floor, runs, lambda _: floor_produce(floor.url, batch,
                                                                    messages // BATCH))
            figures.append(Figure(
                "  produce floor: a bare Flight server in Python reading the same batches and "
                "acking each (instructions per message)", "instr",
                [c / messages for c in runs_in], "the broker's produce", own_produce,
                higher_is_better=False))
        if "consume" in names:
            runs_out = _counted(floor, runs, lambda _: floor_consume(floor.url, messages))
            figures.append(Figure(
                "  consume floor: a bare Flight server streaming the same batches from memory, "
                "one ack action each (instructions per message)", "instr",
                [c / messages for c in runs_out], "the broker's exclusive receive + ack",
                own_consume, higher_is_better=False))
    return figures


#: the benchmarks whose path ``--instructions`` counts
PATHS = ("produce", "consume", "pulsar-produce", "pulsar-consume")


if __name__ == "__main__":  # the count at another revision (_against): OUT MESSAGES RUNS NAME...
    _out, _messages, _runs, *_names = sys.argv[1:]
    Path(_out).write_text(json.dumps(_count(_names, int(_messages), int(_runs))))
