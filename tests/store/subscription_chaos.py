"""Subscription chaos: consumer processes that join, close and are SIGKILLed, and a broker
SIGKILL, while a producer writes keyed messages.

Each message's value is ``key|i`` (the i-th message of its key). Workers
(tests/store/subscription_worker.py) log every batch they receive before acknowledging it, and
every ack's start and end. At the end the logs are checked:

- every message was received, and the subscription's backlog is 0;
- no message was received after an ack of it had returned; an ack that a broker outage made
  resend either returns (then nothing of it comes again) or raises AckInDoubtError, after
  which another consumer may receive its messages once more (at least once, as in Pulsar);
- ``key_shared``: per-key order across every rebalance (PIP-379) — a consumer receives message
  i of a key only once every earlier message of the key was acknowledged (its ack had started)
  or is held by that same consumer;
- ``key_shared``: the keys of the last four consumers are within 1.5x of an even split.

With ``--client pulsar`` the producer and the consumers are the real Pulsar client
(``pulsar-client``, through the broker's Pulsar listener; consumers are
``tests/pulsar_wire/pulsar_worker.py``). Its ``acknowledge`` returns once the ack is queued
(acks are grouped and sent within 100 ms, without receipts), so an ack that returned less
than :data:`LOST_ACK_S` before a SIGKILL of the broker or of its consumer, or during a
broker outage, may be lost, and its message delivered again: counted as ``lost_acks``, not
as a failure (at least once, as with Pulsar's own broker). Every other check is the same.

The suite runs short versions (``test_subscription_chaos.py``,
``tests/pulsar_wire/test_pulsar_chaos.py``); ``make chaos`` the long ones::

    python -m tests.store.subscription_chaos --messages 400000 --rounds 6
    python -m tests.store.subscription_chaos --client pulsar --messages 200000 --rounds 6

It prints the outcome per type and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstream.broker.process import BrokerProcess
from tierstream.broker.subscriptions.selectors import slot_owners
from tierstream.client import Admin, Producer
from tierstream.model.message_format import key_hash

from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/chaos/orders"
SUBSCRIPTION = "billing"
#: how long before a crash an ack of the Pulsar client that returned may still be unsent
#: (its 100 ms grouping, plus the time to reach the broker and be stored on a busy machine)
LOST_ACK_S = 0.1 + scaled(1.0)
#: per client: the consumer process's module
WORKERS = {"tierstream": "tests.store.subscription_worker",
           "pulsar": "tests.pulsar_wire.pulsar_worker"}


@dataclass
class Outcome:
    mode: str
    messages: int
    received: int = 0
    missing: int = 0
    after_ack: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)
    backlog: int = -1
    spread: float | None = None  # key_shared: the most keys a final consumer has, over even
    worker_kills: int = 0
    closes: int = 0
    joins: int = 0
    broker_kills: int = 0
    redelivered: int = 0
    in_doubt: int = 0  # received elsewhere after an ack of it raised AckInDoubtError
    doubtful_acks: int = 0  # acks that raised AckInDoubtError
    lost_acks: int = 0  # Pulsar client: received again after an ack a crash may have lost
    client: str = "tierstream"
    outages: list[tuple[float, float]] = field(default_factory=list)
    seconds: float = 0.0
    drain_seconds: float = 0.0  # from the producer's end until the backlog was 0

    @property
    def ok(self) -> bool:
        return (self.missing == 0 and not self.after_ack and not self.out_of_order
                and self.backlog == 0 and (self.spread is None or self.spread <= 1.5))

    def __str__(self) -> str:
        return (f"{self.mode} ({self.client} client): {self.messages:,} messages, "
                f"{self.received:,} received ({self.redelivered:,} redelivered), missing "
                f"{self.missing}, received after "
                f"their ack {len(self.after_ack)}, out of key order {len(self.out_of_order)}, "
                f"backlog {self.backlog}, {self.doubtful_acks} acks in doubt "
                f"({self.in_doubt} of their messages received again)"
                + (f", {self.lost_acks} received again after an ack a crash lost"
                   if self.client == "pulsar" else "")
                + (f", key spread {self.spread:.2f}x even" if self.spread is not None else "")
                + f"; {self.joins} joins, {self.closes} closes, {self.worker_kills} consumer "
                f"kills, {self.broker_kills} broker kills, {self.seconds:.1f}s "
                f"({self.drain_seconds:.1f}s draining after the producer)"
                + (f"; broker outages {[(round(a, 3), round(b, 3)) for a, b in self.outages]}"
                   if not self.ok else "")
                + "".join(f"\n  {line}" for line in (self.after_ack + self.out_of_order)[:10]))


class _Workers:
    def __init__(self, url: str, mode: str, logs: Path, module: str) -> None:
        self.url, self.mode, self.logs, self.module = url, mode, logs, module
        self.live: dict[str, subprocess.Popen[str]] = {}
        self.count = 0
        self.killed: dict[str, float] = {}  # consumer name: when it was SIGKILLed

    def start(self) -> str:
        self.count += 1
        name = f"w{self.count}"
        proc = subprocess.Popen(
            [sys.executable, "-m", self.module, self.url, TOPIC,
             SUBSCRIPTION, self.mode, name, str(self.logs / f"{name}.jsonl")],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise AssertionError(f"worker {name} did not start: {line!r}")
        self.live[name] = proc
        return name

    def close(self, name: str) -> None:
        proc = self.live.pop(name)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=scaled(60))

    def kill(self, name: str) -> None:
        proc = self.live.pop(name)
        self.killed[name] = time.monotonic()
        proc.kill()
        proc.wait(timeout=scaled(60))

    def stop_all(self) -> None:
        for name in list(self.live):
            self.close(name)


#: one round of what happens to the consumers and the broker while the producer writes
ROUND = ["join", "join", "close", "kill", "broker", "join"]


def run(data_dir: Path, port: int, *, mode: str, messages: int, rounds: int = 1,
        keys: int = 200, seed: int = 0, steps: list[str] | None = None,
        client: str = "tierstream", routing: str = "tierstream") -> Outcome:
    """One chaos run. ``routing`` (Pulsar client): ``tierstream`` routes keys with
    ``key_router``; ``client`` leaves the producer as an application has it, keys routed by
    the client's own hash (BoostHash), so the topic turns client-routed."""
    rng = random.Random(seed)
    outcome = Outcome(mode, messages, client=client)
    started = time.monotonic()
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    args = [] if client == "tierstream" else ["--pulsar-port", str(_free_port())]
    broker = BrokerProcess(data_dir / "store", port=port, args=args).start()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 4, exist_ok=True)
    workers = _Workers(broker.url if client == "tierstream" else str(broker.pulsar_url), mode,
                       logs, WORKERS[client])
    produced = [0]
    error: list[BaseException] = []

    def produce_pulsar() -> None:
        import pulsar

        from tierstream.pulsar_protocol import key_router

        pulsar_client = pulsar.Client(str(broker.pulsar_url), operation_timeout_seconds=120,
                                      logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        try:
            router = {"message_router": key_router} if routing == "tierstream" else {}
            producer = pulsar_client.create_producer(
                f"persistent://{TOPIC}", producer_name="chaos-writer", batching_enabled=True,
                send_timeout_millis=0, **router)  # resent until stored
            for start in range(0, messages, 1000):
                for n in range(start, min(messages, start + 1000)):
                    key = f"key-{n % keys}"
                    producer.send_async(f"{key}|{n // keys}".encode(), None, partition_key=key)
                producer.flush()  # raises on any failure
                produced[0] = min(messages, start + 1000)
            producer.close()
        except BaseException as exc:
            error.append(exc)
        finally:
            pulsar_client.close()

    def produce() -> None:
        def messages_() -> Any:
            for n in range(messages):
                produced[0] = n
                yield {"key": f"key-{n % keys}", "value": f"key-{n % keys}|{n // keys}".encode()}
        try:
            with Producer(TOPIC, broker=broker.url, name="chaos-writer", batch_size=100,
                          send_timeout=scaled(120)) as producer:
                producer.send_many(messages_())
            produced[0] = messages
        except BaseException as exc:
            error.append(exc)

    try:
        for _ in range(2):
            workers.start()
        writer = threading.Thread(target=produce if client == "tierstream" else produce_pulsar,
                                  daemon=True)
        writer.start()
        steps = (steps or ROUND) * rounds
        for i, step in enumerate(steps):
            mark = messages * (i + 1) // (len(steps) + 2)
            wait_for(lambda m=mark: produced[0] >= m or bool(error), timeout=scaled(300),
                     what=f"the producer to pass {mark:,} messages")
            if step == "join" or (step in ("close", "kill") and len(workers.live) < 3):
                workers.start()
                outcome.joins += 1
            elif step == "close":
                workers.close(rng.choice(sorted(workers.live)))
                outcome.closes += 1
            elif step == "kill":
                workers.kill(rng.choice(sorted(workers.live)))
                outcome.worker_kills += 1
            else:
                down = time.monotonic()
                broker.kill()
                time.sleep(rng.uniform(0.1, 1.0))
                broker = BrokerProcess(data_dir / "store", port=port, args=args).start()
                outcome.outages.append((down, time.monotonic()))
                outcome.broker_kills += 1
        while len(workers.live) > 4:
            workers.close(sorted(workers.live)[0])
            outcome.closes += 1
        while len(workers.live) < 4:
            workers.start()
            outcome.joins += 1
        writer.join(timeout=scaled(600))
        if error:
            raise error[0]
        drained = time.monotonic()
        with Admin(broker.url) as admin:
            def backlog() -> int:
                return sum(r["backlog"] for r in admin.subscriptions(TOPIC)
                           if r["subscription"] == SUBSCRIPTION)
            wait_for(lambda: backlog() == 0, timeout=scaled(300),
                     what="every message to be acknowledged")
            outcome.backlog = backlog()
        outcome.drain_seconds = time.monotonic() - drained
        final = sorted(workers.live)
        workers.stop_all()
    finally:
        for proc in workers.live.values():
            proc.kill()
        broker.kill()
    lossy: dict[str | None, list[tuple[float, float]]] = defaultdict(list)
    if client == "pulsar":  # when a returned ack of the Pulsar client may have been lost
        lossy[None] = [(a - LOST_ACK_S, b) for a, b in outcome.outages]
        for name, at in workers.killed.items():
            lossy[name].append((at - LOST_ACK_S, at))
    _check(outcome, logs, keys, lossy)
    if mode == "key_shared":
        owners = slot_owners(final, [None] * len(final))
        per = defaultdict(int)
        for k in range(keys):
            per[int(owners[key_hash(f"key-{k}")])] += 1
        outcome.spread = max(per.values()) / (keys / len(final))
    outcome.seconds = time.monotonic() - started
    return outcome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(outcome: Outcome, logs: Path, keys: int,
           lossy: dict[str | None, list[tuple[float, float]]] | None = None) -> None:
    """``lossy``: per consumer name (None: any), the times in which an ack that returned may
    have been lost (the Pulsar client's)."""
    # t, consumer, key, i, redelivery count, position
    receives: list[tuple[float, str, str, int, int, str]] = []
    # who acknowledged the message with an ack that raised AckInDoubtError, and when
    doubted: dict[tuple[str, int], float] = {}
    ack_start: dict[tuple[str, int], float] = {}
    ack_end: dict[tuple[str, int], float] = {}  # acks that returned: the first one's end
    returned: dict[tuple[str, int], list[tuple[float, str]]] = defaultdict(list)  # all
    for path in logs.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line of a killed worker
            if rec["e"] == "r":
                for value, count, where in rec["m"]:
                    key, i = value.rsplit("|", 1)
                    receives.append((rec["t"], rec["c"], key, int(i), count, where))
            elif rec["e"] == "s":  # an ack started (a killed worker's may have been stored)
                for value in rec["m"]:
                    key, i = value.rsplit("|", 1)
                    k = (key, int(i))
                    ack_start[k] = min(ack_start.get(k, rec["t"]), rec["t"])
            else:
                outcome.doubtful_acks += rec["e"] == "d"
                for value in rec["m"]:
                    key, i = value.rsplit("|", 1)
                    k = (key, int(i))
                    ack_start[k] = min(ack_start.get(k, rec["t0"]), rec["t0"])
                    ends = ack_end if rec["e"] == "a" else doubted
                    ends[k] = min(ends.get(k, rec["t1"]), rec["t1"])
                    if rec["e"] == "a":
                        returned[k].append((rec["t1"], rec["c"]))
    receives.sort()
    seen = {(key, i) for _, _, key, i, _, _ in receives}
    outcome.received = len(receives)
    outcome.redelivered = sum(1 for r in receives if r[4] > 0)
    expected = {(f"key-{n % keys}", n // keys) for n in range(outcome.messages)}
    outcome.missing = len(expected - seen)
    last: dict[str, dict[int, str]] = defaultdict(dict)
    floor: dict[str, int] = defaultdict(int)
    first: dict[tuple[str, int], tuple[float, str, str]] = {}
    windows = lossy or {}

    def kept(k: tuple[str, int], t: float) -> float | None:
        """The end of the first ack of ``k`` that returned before ``t`` and that no crash
        may have lost (None: there is none)."""
        for at, who in sorted(returned.get(k, [])):
            if at < t and not any(a <= at <= b for w in (windows.get(None, []),
                                                         windows.get(who, []))
                                  for a, b in w):
                return at
        return None

    for t, consumer, key, i, count, where in receives:
        if ack_end.get((key, i), float("inf")) < t and kept((key, i), t) is None:
            outcome.lost_acks += 1  # at least once, as the Pulsar client's acks are
        elif ack_end.get((key, i), float("inf")) < t:
            ft, fc, fw = first[(key, i)]
            outcome.after_ack.append(f"{key}|{i} (at {where}, redelivery {count}) received by "
                                     f"{consumer} at {t:.3f} after its ack returned at "
                                     f"{ack_end[(key, i)]:.3f} (first received by {fc} at "
                                     f"{ft:.3f}, at {fw})")
        elif doubted.get((key, i), float("inf")) < t:
            # the new broker sent it to this consumer before another's resent ack reached
            # it, and that ack said so (AckInDoubtError): at least once, as Pulsar
            outcome.in_doubt += 1
        if outcome.mode == "key_shared":
            while ack_start.get((key, floor[key]), float("inf")) < t:
                floor[key] += 1
            for j in range(floor[key], i):
                if ack_start.get((key, j), float("inf")) < t or last[key].get(j) == consumer:
                    continue
                outcome.out_of_order.append(
                    f"{key}|{i} received by {consumer} at {t:.3f} while {key}|{j} was "
                    f"unacknowledged{' at ' + last[key][j] if j in last[key] else ''}")
                break
        last[key][i] = consumer
        first.setdefault((key, i), (t, consumer, where))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default="key_shared,shared")
    parser.add_argument("--client", choices=sorted(WORKERS), default="tierstream")
    parser.add_argument("--routing", choices=["tierstream", "client"], default="tierstream",
                        help="with --client pulsar: route keys with key_router, or as the "
                             "client does unchanged")
    args = parser.parse_args()
    failed = False
    for mode in args.modes.split(","):
        tmp = Path(tempfile.mkdtemp(prefix=f"subscription-chaos-{mode}-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        outcome = run(tmp, port, mode=mode, messages=args.messages, rounds=args.rounds,
                      client=args.client, routing=args.routing)
        print(outcome, flush=True)
        if outcome.ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"  consumer logs kept in {tmp / 'logs'}", flush=True)
        failed |= not outcome.ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
