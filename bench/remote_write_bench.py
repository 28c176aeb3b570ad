"""``python -m bench remote-write``: produce msg/s into a store whose bookies are network
services (``tierstream bookie serve --metadata``, three processes on loopback, write quorum 3,
ack quorum 2) beside the same store with three bookie directories in the broker's process
(also 3/2), in alternating rounds of the same run. Both keep their metadata on the same
PostgreSQL server and fsync every group of writes (the bookies and the local directories
alike), so the difference is the network path: an entry's bytes cross a Flight stream to each
bookie and its ack comes back.

On loopback the network costs only CPU (serialisation, gRPC, one more process per bookie):
on a 2-core machine the three bookie processes and the broker share the cores, which real
hosts would not. Bookies on other hosts add their round trip to each group commit.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Figure, console, report
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer

VALUE = b"x" * 100


def remote_write(quick: bool = True) -> Path:
    from tests.network_store import BookieProcess
    from tests.postgres import PostgresServer

    messages, rounds = (100_000, 3) if quick else (300_000, 5)
    runs: dict[str, list[float]] = {"network": [], "local": []}
    server = PostgresServer(fsync=True)
    bookies: list[Any] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = server.new_database()
            bookies = [BookieProcess(Path(tmp) / f"bookie-{i}", url, host_label=f"host-{i}",
                                     fsync=True).start() for i in range(3)]
            quorum = ["--write-quorum", "3", "--ack-quorum", "2"]
            for r in range(rounds):
                for kind in ("network", "local"):
                    data = Path(tmp) / f"{kind}-{r}"
                    db = server.new_database()  # a fresh store per run, on the same server
                    if kind == "network":  # the running bookies, registered there too
                        _register(db, bookies)
                        args = ["--metadata", db, "--network-bookies", *quorum]
                    else:
                        args = ["--metadata", db, "--bookies", "3", *quorum]
                    rate = _produce(data, args, f"bench/remote/r{r}", messages)
                    runs[kind].append(rate)
                    console.print(f"round {r + 1}: {kind} {rate:,.0f} msg/s")
    finally:
        for b in bookies:
            b.kill()
        server.stop()
    figures = [Figure("produce, 3 network bookies (wq3/aq2)", "msg/s", runs["network"],
                      "3 local bookie directories (wq3/aq2)", runs["local"],
                      aim=">= 0.7 of local", aim_check=lambda _v, r: r is not None and r >= 0.7)]
    return report("remote-write", figures, {"messages": messages, "rounds": rounds,
                                            "value_bytes": len(VALUE), "partitions": 4,
                                            "batch_size": 100})


def _register(url: str, bookies: list[Any]) -> None:
    """The running bookies, registered in another database (as they would be in one)."""
    from tierstream.metadata.bookie_registry import set_bookie_endpoint
    from tierstream.metadata.store import MetadataStore

    store = MetadataStore(url, hold=False)
    try:
        for i, b in enumerate(bookies):
            set_bookie_endpoint(store, f"bookie-{i}", b.url, host=f"host-{i}", writable=True)
    finally:
        store.close()


def _produce(data: Path, args: list[str], topic: str, messages: int) -> float:
    broker = BrokerProcess(data, args=args).start(timeout=120)
    try:
        with Admin(broker.url) as admin:
            admin.create_topic(topic, 4)
        with Producer(topic, broker=broker.url, batch_size=100) as producer:
            producer.send_many({"value": VALUE, "key": f"k{i % 64}"} for i in range(1000))
            producer.flush()  # connected and warm
            start = time.perf_counter()
            producer.send_many({"value": VALUE, "key": f"k{i % 64}"}
                               for i in range(messages))
            producer.flush()
            return messages / (time.perf_counter() - start)
    finally:
        broker.kill()
