"""Client churn: clients of both kinds open, close and are SIGKILLed in a tight loop against
one broker, with a broker SIGKILL and restart in the middle. The broker must never crash.

Clients (``tests/store/churn_client.py``, one process each) are tierstream's ``Consumer`` of
every subscription type, ``Producer`` and tailing reader, and the real Pulsar client's
consumers and producer. Each is ended at a random moment after it started — often while it
is still connecting or attaching, which is when a broker meets a stream whose client is
already gone — by SIGTERM (a clean close) or SIGKILL (a crash). The run fails if the broker
process exits, or if its log holds a fatal-signal stack (``faulthandler``: the CLI turns it
on in every process, so a segfault leaves the stacks of all threads), or if the broker does
not serve a fresh consumer at the end.

The suite runs a short version (``test_client_churn.py``); ``make chaos`` the long one::

    python -m tests.store.client_churn --kills 1000

It prints what happened and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset

from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/churn/events"
TYPES = ("exclusive", "failover", "shared", "key_shared")
KINDS = ([f"ts-consumer-{t}" for t in TYPES] + ["ts-producer", "ts-tail"]
         + [f"pulsar-consumer-{t}" for t in TYPES] + ["pulsar-producer"])


@dataclass
class Outcome:
    started: int = 0
    closes: int = 0
    kills: int = 0
    broker_restarts: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        return (f"{self.started} clients started, {self.closes} closed, {self.kills} SIGKILLed, "
                f"{self.broker_restarts} broker restart(s), {self.seconds:.1f}s: "
                + ("ok" if self.ok else "FAILED\n  " + "\n  ".join(self.failures)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fatal_lines(broker: BrokerProcess) -> str:
    """The start of a fatal-signal report in the broker's log, with the crashed thread's
    stack ("" when there is none)."""
    return "".join(broker.fatal)


def run(data_dir: Path, *, kills: int, seed: int = 0, max_live: int = 8,
        restart_broker: bool = True) -> Outcome:
    """Churn until ``kills`` clients were SIGKILLed (about as many are closed), restarting the
    broker (SIGKILL) halfway."""
    rng = random.Random(seed)
    outcome = Outcome()
    begun = time.monotonic()
    port, pulsar_port = _free_port(), _free_port()
    args = ["--pulsar-port", str(pulsar_port)]
    broker = BrokerProcess(data_dir, port=port, args=args).start()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 4, exist_ok=True)
    live: list[tuple[subprocess.Popen[bytes], float]] = []  # process, when to end it
    closing: list[tuple[subprocess.Popen[bytes], float]] = []  # SIGTERMed: by when
    root = Path(__file__).resolve().parents[2]

    def check_broker(when: str) -> bool:
        fatal = _fatal_lines(broker)
        if broker.proc is not None and broker.proc.poll() is not None:
            outcome.failures.append(f"the broker exited ({broker.proc.returncode}) {when}: "
                                    + (fatal or "".join(list(broker.stderr_tail)[-30:])))
            return False
        if fatal:
            outcome.failures.append(f"the broker's log has a fatal signal {when}:\n{fatal}")
            return False
        return True

    try:
        restart_at = kills // 2 if restart_broker else -1
        while outcome.kills < kills:
            if not check_broker(f"after {outcome.kills} client kills"):
                break
            now = time.monotonic()
            for entry in [e for e in closing if e[0].poll() is not None or e[1] <= now]:
                closing.remove(entry)  # closed, or past its deadline to close: SIGKILLed
                entry[0].kill()
                entry[0].wait()
            for entry in [e for e in live if e[1] <= now]:
                live.remove(entry)
                proc = entry[0]
                if proc.poll() is None and rng.random() < 0.5:
                    proc.send_signal(signal.SIGTERM)
                    closing.append((proc, now + scaled(30)))
                    outcome.closes += 1
                    continue
                proc.kill()
                proc.wait()
                outcome.kills += 1
                if outcome.kills == restart_at:
                    broker.kill()
                    broker = BrokerProcess(data_dir, port=port, args=args).start()
                    outcome.broker_restarts += 1
            while len(live) + len(closing) < max_live:
                kind = rng.choice(KINDS)
                name = f"c{outcome.started}"
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.store.churn_client", kind, str(broker.url),
                     str(broker.pulsar_url), TOPIC, name],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
                outcome.started += 1
                # ended anywhere from mid-start (still attaching) to well into its work
                live.append((proc, time.monotonic() + rng.uniform(0.0, scaled(3.0))))
            time.sleep(0.02)  # a pacing interval: the loop's conditions are checked above
        if not outcome.failures and check_broker("at the end"):
            _check_serves(broker.url)
    except AssertionError as exc:
        outcome.failures.append(str(exc))
    finally:
        for proc, _ in live + closing:
            proc.kill()
            proc.wait()
        check_broker("after the clients left") if not outcome.failures else None
        broker.kill()
    outcome.seconds = time.monotonic() - begun
    return outcome


def _check_serves(url: str) -> None:
    """A fresh producer and consumer still work: the broker is not only alive but serving."""
    with Producer(TOPIC, broker=url, name="churn-final") as producer:
        producer.send_many([{"key": "final", "value": b"final"}])
    got: list[bytes] = []
    with Consumer(TOPIC, "churn-final", mode="shared", broker=url,
                  initial=Offset.earliest()) as consumer:
        def received() -> bool:
            batch = consumer.receive(timeout=0.1)
            if batch is not None:
                got.extend(v for v in batch.column("value").to_pylist() if v == b"final")
                consumer.ack(batch)
            return bool(got)
        wait_for(received, timeout=scaled(60), what="a fresh consumer to receive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-live", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="client-churn-"))
    try:
        outcome = run(tmp, kills=args.kills, seed=args.seed, max_live=args.max_live)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(outcome)
    sys.exit(0 if outcome.ok else 1)


if __name__ == "__main__":
    main()
