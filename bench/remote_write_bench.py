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

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Figure, console, report, sized
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer

VALUE = b"x" * 100


def remote_write(quick: bool = True) -> Path:
    from tests.network_store import BookieProcess
    from tests.postgres import PostgresServer

    messages, rounds = sized((100_000, 3) if quick else (300_000, 5), (2_000, 1))
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
                        args = ["--metadata", db, "--network-bookies", *quorum,
                                "--tier-url", str(Path(tmp) / f"tier-{r}"), "--tier-shared",
                                "--catalog-uri", f"sqlite:///{Path(tmp) / f'catalog-{r}.db'}"]
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


def re_replication(quick: bool = True) -> Path:
    """``python -m bench re-replication``: how long a lost bookie's copies take to be whole
    again. Three network bookies (processes, fsync, wq3/aq2) hold ``size`` MB; one is SIGKILLed,
    its disk emptied, and started with ``--replace``; the figure is MB/s from that start until
    the broker reports nothing under-replicated and every copy whole, beside the baseline of
    copying the same ledger files on the same disk with fsync (the floor of any copy)."""
    import shutil

    from tests.network_store import BookieProcess
    from tests.postgres import PostgresServer

    size_mb, rounds = sized((128, 2) if quick else (1024, 3), (2, 1))
    value = b"y" * 10_000  # 10 kB messages, 100 per entry: ~1 MB entries
    runs: list[float] = []
    baseline: list[float] = []
    server = PostgresServer(fsync=True)
    bookies: list[Any] = []
    try:
        for r in range(rounds):
            with tempfile.TemporaryDirectory() as tmp:
                url = server.new_database()
                bookies = [BookieProcess(Path(tmp) / f"bookie-{i}", url,
                                         host_label=f"host-{i}", fsync=True).start()
                           for i in range(3)]
                broker = BrokerProcess(Path(tmp) / "broker", args=[
                    "--metadata", url, "--network-bookies", "--write-quorum", "3",
                    "--ack-quorum", "2", "--max-segment-bytes", "64MB", "--tier-url",
                    str(Path(tmp) / "tier"), "--tier-shared", "--catalog-uri",
                    f"sqlite:///{Path(tmp) / 'catalog.db'}"]).start(timeout=120)
                try:
                    topic = f"bench/repair/r{r}"
                    with Admin(broker.url) as admin:
                        admin.create_topic(topic, 4)
                    with Producer(topic, broker=broker.url, batch_size=100) as producer:
                        producer.send_many({"value": value, "key": f"k{i % 64}"}
                                           for i in range(size_mb * 100))
                        producer.flush()
                    with Admin(broker.url) as admin:
                        admin.seal(topic)
                    held = _bytes(bookies[1].data_dir)
                    with Admin(broker.url) as admin:
                        copies = sum("bookie-1" in seg.ensemble and seg.state == "CLOSED"
                                     for seg in admin.list_segments(topic))
                        before = admin.stats()["replication"]["re_replicated"]
                    start = time.perf_counter()  # the floor: the same files copied, fsync'd
                    _copy_synced(bookies[1].data_dir / "ledgers", Path(tmp) / "copy")
                    baseline.append(held / 1e6 / (time.perf_counter() - start))
                    shutil.rmtree(Path(tmp) / "copy")
                    bookies[1].wipe()
                    start = time.perf_counter()
                    bookies[1].start("--replace")
                    with Admin(broker.url) as admin:
                        # every copy it held written again (the count rises, then falls to 0)
                        while True:
                            state = admin.stats()["replication"]
                            if state["re_replicated"] - before >= copies and \
                                    state["under_replicated"] == 0:
                                break
                            time.sleep(0.05)  # polling the figure being measured
                    seconds = time.perf_counter() - start
                    runs.append(held / 1e6 / seconds)
                    console.print(f"round {r + 1}: {held / 1e6:,.0f} MB whole again in "
                                  f"{seconds:.1f} s ({runs[-1]:,.1f} MB/s; a plain copy "
                                  f"{baseline[-1]:,.1f} MB/s)")
                finally:
                    broker.kill()
                    for b in bookies:
                        b.kill()
    finally:
        server.stop()
    figures = [Figure("re-replication of a lost bookie's copies", "MB/s", runs,
                      "copying the same ledger files with fsync", baseline)]
    seconds_per_gb = 1000 / statistics.median(runs)
    console.print(f"time to full replication: {seconds_per_gb:,.0f} s per GB")
    return report("re-replication", figures, {"size_mb": size_mb, "rounds": rounds,
                                              "entry_bytes": len(value) * 100},
                  {"seconds_per_gb": seconds_per_gb})


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _copy_synced(src: Path, dst: Path) -> None:
    import os
    import shutil

    for path in src.rglob("*"):
        if path.is_file():
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
