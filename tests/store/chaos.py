"""Kill-cycle chaos: a broker SIGKILLed again and again under named producer processes.

Each cycle restarts the broker on the same address and data directory with new small segment
settings (2-40 entries per segment, 1-3 s rollover), waits until the producers get new
acknowledgements, lets them run a random while longer, and kills it. At the end the producers
stop (each flushes what it has in flight), the whole topic is read back, and
:mod:`tests.store.crashcheck` compares it with every acknowledged send.

The suite runs a short version (``test_kill_cycles.py``); ``make chaos`` runs the long one::

    python -m tests.store.chaos --cycles 100
    python -m tests.store.chaos --cycles 100 --postgres   # metadata on PostgreSQL

and prints cycles, acknowledged, missing, duplicated and order violations per configuration;
it exits 1 if any is non-zero.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.errors import UnavailableError

from ..timing import scaled
from .crashcheck import Report, check, send_numbered
from .helpers import read_all, wait_for

TOPIC = "acme/chaos/events"
REPO = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, tuple[str, ...]] = {
    "1-bookie": (),
    "3-bookies-wq3-aq2": ("--bookies", "3", "--write-quorum", "3", "--ack-quorum", "2"),
}


@dataclass
class Outcome:
    config: str
    cycles: int
    report: Report
    seconds: float

    def line(self) -> str:
        r = self.report
        return (f"{self.config}: cycles {self.cycles}, acknowledged {r.acknowledged}, "
                f"missing {len(r.missing)}, duplicated {len(r.duplicated)}, order violations "
                f"{len(r.order)}, moved {len(r.moved)}, publish_time violations {len(r.time)} "
                f"({self.seconds:.0f}s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _acked_bytes(outs: list[Path]) -> int:
    return sum(o.stat().st_size for o in outs if o.exists())


def _sends(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def run_cycles(work: Path, *, config: str, cycles: int, producers: int = 3,
               partitions: int = 2, seed: int = 0, extra_uptime: float = 1.5,
               log: Callable[[str], None] = lambda _: None,
               metadata: str | None = None) -> Outcome:
    """Run ``cycles`` SIGKILL/restart cycles on a fresh data directory under ``work``
    (``metadata``: a PostgreSQL URL for the broker's metadata; None: SQLite)."""
    rng = random.Random(seed)
    started = time.monotonic()
    data = work / f"data-{config}"
    port = _free_port()

    def start_broker() -> BrokerProcess:
        args = [*CONFIGS[config], "--max-entries-per-segment", str(rng.randint(2, 40)),
                "--segment-rollover-time", f"{rng.randint(1000, 3000)}ms",
                *(["--metadata", metadata] if metadata else [])]
        return BrokerProcess(data, port=port, args=args).start()

    broker = start_broker()
    procs: list[subprocess.Popen[str]] = []
    outs = [work / f"{config}-p{i}.jsonl" for i in range(producers)]
    stop = work / f"{config}.stop"
    try:
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, partitions)
        for i, out in enumerate(outs):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.store.chaos", "produce", "--broker", broker.url,
                 "--name", f"p{i}", "--out", str(out), "--stop", str(stop),
                 "--seed", str(seed * 100 + i)],
                cwd=REPO, stderr=subprocess.PIPE, text=True))
        kills = 0
        for cycle in range(cycles):
            # Kill only under load: wait until the producers got new acks from this broker.
            before = _acked_bytes(outs)
            wait_for(lambda b=before: _acked_bytes(outs) > b  # type: ignore[misc]
                     or any(p.poll() is not None for p in procs), timeout=scaled(60),
                     what=f"acknowledgements in cycle {cycle}")
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(rng.uniform(0, extra_uptime))  # the kill schedule, not a synchronisation
            assert broker.proc is not None and broker.proc.poll() is None
            broker.kill()
            if broker.proc.returncode == -signal.SIGKILL:
                kills += 1
            broker = start_broker()
            log(f"{config}: cycle {cycle + 1}/{cycles}")
        stop.touch()
        for p in procs:
            try:
                _, stderr = p.communicate(timeout=scaled(180))
            except subprocess.TimeoutExpired:
                p.kill()
                _, stderr = p.communicate()
            if p.returncode != 0:
                raise AssertionError(f"producer exited {p.returncode}: {stderr[-2000:]}")
        table = read_all(broker.url, TOPIC)
        report = check(table, [s for o in outs for s in _sends(o)])
        return Outcome(config + (" (PostgreSQL metadata)" if metadata else ""), kills, report,
                       time.monotonic() - started)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        broker.kill()


def _open_producer(args: argparse.Namespace) -> Producer:
    """A producer, opened as soon as the broker (maybe restarting now) answers."""
    deadline = time.monotonic() + scaled(120)
    while True:
        try:
            return Producer(TOPIC, broker=args.broker, name=args.name, batch_size=3,
                            send_timeout=scaled(120))
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # a retry interval while the broker restarts


def _produce(args: argparse.Namespace) -> None:
    """One named producer process: numbered sends of 1-12 messages until the stop file
    appears; each acknowledged send is appended to ``--out`` as a JSON line. The producer is
    closed and opened again under the same name after its first send and every 25 sends, as a
    restarted program would (it must continue after its last stored sequence ids)."""
    rng = random.Random(args.seed)
    stop, out = Path(args.stop), Path(args.out)
    n = sends = 0
    with open(out, "a") as f:
        while not stop.exists():
            with _open_producer(args) as producer:
                while not stop.exists():
                    count = rng.randint(1, 12)
                    f.write(json.dumps(send_numbered(producer, n, count)) + "\n")
                    f.flush()
                    n += count
                    sends += 1
                    if sends == 1 or sends % 25 == 0:
                        break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.store.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    produce = sub.add_parser("produce", help="(internal) one producer process")
    produce.add_argument("--broker", required=True)
    produce.add_argument("--name", required=True)
    produce.add_argument("--out", required=True)
    produce.add_argument("--stop", required=True)
    produce.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--postgres", action="store_true",
                        help="keep the broker's metadata on a PostgreSQL started for the run")
    args = parser.parse_args(argv)
    if args.command == "produce":
        _produce(args)
        return 0
    configs = list(CONFIGS) if args.config == "all" else [args.config]
    failed = False
    print(f"chaos: {args.cycles} kill cycles per configuration, seed {args.seed}", flush=True)
    server = None
    if args.postgres:
        from ..postgres import PostgresServer

        server = PostgresServer()
    with tempfile.TemporaryDirectory(prefix="tierstream-chaos-") as tmp:
        for config in configs:
            outcome = run_cycles(Path(tmp), config=config, cycles=args.cycles, seed=args.seed,
                                 log=lambda m: print(m, file=sys.stderr, flush=True),
                                 metadata=server.new_database() if server else None)
            print(outcome.line(), flush=True)
            if not outcome.report.ok:
                failed = True
                print(f"  {outcome.report}", flush=True)
    if server is not None:
        server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
