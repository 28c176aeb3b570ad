"""Pulsar Key_Shared consumers of a partitioned topic that grows under them: each key's
messages arrive in order across the scale event, every message is received, the backlog
reaches 0.

A tierstream producer writes ``key|i`` messages, growing the topic 2 -> 4 after 80% of them
(it follows the event at once); two real Pulsar client consumers (each its own client)
receive and acknowledge, slowly enough (:data:`PER_MESSAGE_S` each) that when their clients
find the new partitions, the old ones still hold earlier messages of the keys that moved:
the broker must hold those keys in the new partitions until their earlier messages are
acknowledged (the scale-event gate tierstream's own consumers get). The Python client looks
for new partitions every 60 s (C++ ``partitionsUpdateInterval``; the Python wrapper cannot
shorten it), so this runs for about 3 minutes and belongs in ``make chaos``::

    python -m tests.pulsar_wire.scale_follow [--messages N] [--producer pulsar]

With ``--producer pulsar`` the producer is a real Pulsar client too, unchanged (its default
BoostHash routing, which makes the topic client-routed): the growth is announced, the producer
routes by 2 until its own poll finds 4 partitions (it keeps writing for 90 s after the growth),
and the broker records the event ``--client-refresh-wait`` (75 s) after announcing it; the
new partitions' messages must still arrive after each key's earlier ones.

It prints the outcome and exits 1 on any failure. The order check: per key, the first
receipts, in receive time across both consumers, come in the key's order; a message received
again (redelivery) must not come after a later one of its key was acknowledged by another.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import each_message

TOPIC = "acme/web/pulsar-follows"
SUBSCRIPTION = "follow"
#: the Python client's partition poll (C++ ClientConfiguration's default)
POLL_S = 60.0
#: each consumer's pause per message: both together take ~3 minutes for 30,000 messages, so
#: a third of the old partitions' messages are still there when the new ones are found
PER_MESSAGE_S = 0.010


def run(data_dir: Path, *, messages: int = 30_000, keys: int = 100,
        producer: str = "tierstream") -> list[str]:
    """The problems found (empty: none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pulsar_port = s.getsockname()[1]
    broker = BrokerProcess(data_dir, args=["--pulsar-port", str(pulsar_port),
                                           "--client-refresh-wait", f"{POLL_S + 15:.0f}s"]
                           ).start()
    problems: list[str] = []
    threads: list[threading.Thread] = []
    received: list[tuple[float, str, str, int, int]] = []  # t, consumer, key, i, partition
    lock = threading.Lock()
    stop = threading.Event()
    clients = [pulsar.Client(str(broker.pulsar_url), operation_timeout_seconds=60,
                             logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
               for _ in range(2)]
    try:
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 2)

        def consume(n: int) -> None:
            consumer = clients[n].subscribe(
                f"persistent://{TOPIC}", SUBSCRIPTION, consumer_name=f"c{n}",
                consumer_type=pulsar.ConsumerType.KeyShared, receiver_queue_size=200,
                initial_position=pulsar.InitialPosition.Earliest)

            def keep(msg: Any) -> None:
                key, i = msg.data().decode().rsplit("|", 1)
                with lock:
                    received.append((time.monotonic(), f"c{n}", key, int(i),
                                     msg.message_id().partition()))
                consumer.acknowledge(msg)
                time.sleep(PER_MESSAGE_S)

            each_message(consumer, stop, keep)
            consumer.close()

        threads += [threading.Thread(target=consume, args=(n,), daemon=True) for n in range(2)]
        for t in threads:
            t.start()

        def produce() -> None:
            with Producer(TOPIC, broker=broker.url, batch_size=200) as producer:
                def rows() -> Any:
                    for n in range(messages):
                        if n == messages * 4 // 5:
                            with Admin(broker.url) as admin:
                                admin.set_partitions(TOPIC, 4)
                        yield {"key": f"key-{n % keys}", "value": f"key-{n % keys}|"
                                                                  f"{n // keys}".encode()}
                producer.send_many(rows())

        def produce_pulsar() -> None:
            client = pulsar.Client(str(broker.pulsar_url), operation_timeout_seconds=60,
                                   logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
            try:
                sender = client.create_producer(f"persistent://{TOPIC}",
                                                batching_max_publish_delay_ms=5,
                                                block_if_queue_full=True)
                failed: list[str] = []

                def sent(result: Any, _msg_id: Any) -> None:
                    if result != pulsar.Result.Ok:
                        if not failed:
                            print(f"a send failed {time.monotonic() - started:.1f}s in: "
                                  f"{result}", flush=True)
                        failed.append(str(result))

                grow_at, grown = messages * 4 // 5, 0.0
                for n in range(messages):
                    if n == grow_at:
                        with Admin(broker.url) as admin:
                            admin.set_partitions(TOPIC, 4)
                        grown = time.monotonic()
                    elif n > grow_at and n % 50 == 0:  # the rest over the poll and then some
                        due = grown + (n - grow_at) / (messages - grow_at) * (POLL_S + 30)
                        time.sleep(max(0.0, due - time.monotonic()))
                    key = f"key-{n % keys}"
                    sender.send_async(f"{key}|{n // keys}".encode(), sent, partition_key=key)
                sender.flush()
                if failed:
                    problems.append(f"{len(failed)} sends failed, e.g. {failed[0]}")
            finally:
                client.close()

        started = time.monotonic()
        produce_pulsar() if producer == "pulsar" else produce()
        distinct = lambda: len({(k, i) for _, _, k, i, _ in list(received)})  # noqa: E731
        wait_for(lambda: distinct() == messages, timeout=2 * POLL_S + scaled(180),
                 what="every message, the new partitions' included")
        with Admin(broker.url) as admin:
            def backlog() -> int:
                return sum(r["backlog"] for r in admin.subscriptions(TOPIC)
                           if r["subscription"] == SUBSCRIPTION)
            wait_for(lambda: backlog() == 0, timeout=scaled(60), what="a backlog of 0")
        first_new = min(t for t, *_, p in received if p >= 2)
        print(f"{messages:,} messages through a scale event 2 -> 4 in "
              f"{time.monotonic() - started:.1f}s; partitions received from: "
              f"{sorted({p for *_, p in received})}; the first message from a new partition "
              f"came {first_new - started:.1f}s in, "
              f"{sum(1 for t, *_, p in received if p < 2 and t > first_new):,} messages of the "
              "old partitions after it", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=scaled(30))
        for c in clients:
            c.close()
        broker.kill()
    first_new = min((t for t, *_, p in received if p >= 2), default=None)
    if first_new is None or not any(p < 2 and t > first_new for t, *_, p in received):
        problems.append("the old partitions were drained before the new ones were found: "
                        "the scale-event gate was not exercised (slow the consumers down)")
    if sorted({p for *_, p in received}) != [0, 1, 2, 3]:
        problems.append(f"received from partitions {sorted({p for *_, p in received})} only")
    seen: dict[str, int] = defaultdict(lambda: -1)
    for t, consumer, key, i, p in sorted(received):
        if i > seen[key] + 1:
            problems.append(f"{key}|{i} received by {consumer} at {t:.3f} (partition {p}) "
                            f"before {key}|{seen[key] + 1}")
        seen[key] = max(seen[key], i)
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--producer", choices=["tierstream", "pulsar"], default="tierstream")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pulsar-scale-follow-"))
    problems = run(tmp / "store", messages=args.messages, producer=args.producer)
    for line in problems[:20]:
        print(f"  {line}", flush=True)
    print(f"{len(problems)} problem(s)", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
