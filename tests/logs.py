"""Building real logs for framework tests: an in-process store behind a real Flight broker."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tierstream.broker.config import StoreConfig
from tierstream.broker.flight.server import Broker
from tierstream.broker.store import Store
from tierstream.model.message_format import MESSAGE_SCHEMA, as_produce_batch

TOPIC = "acme/web/clicks"
BASE = 1_793_491_200_000

#: SIGKILL cycles of the Spark chaos tests (a query killed mid-batch, then restarted): a few
#: in the suite, more under ``make chaos`` (TIERSTREAM_SPARK_KILLS)
SPARK_KILLS = int(os.environ.get("TIERSTREAM_SPARK_KILLS", "1"))


@dataclass
class Log:
    store: Store
    broker: Broker
    url: str
    data_dir: Path
    endpoints: list[Any] = field(default_factory=list)  # BookieServer per bookie, if asked

    def kw(self) -> dict[str, Any]:
        return {"data_dir": str(self.data_dir), "broker": self.url}

    def everything(self, topic: str = TOPIC) -> pa.Table:
        """Every message, read by the broker's own path (the brute-force truth)."""
        batches = []
        for plog in self.store.partitions(topic):
            batches.extend(plog.read(plog.earliest(), end=plog.last_confirmed()[1]))
        return pa.Table.from_batches(batches, MESSAGE_SCHEMA)


@contextmanager
def running_log(data_dir: Path, *, bookie_endpoints: bool = False,
                **options: Any) -> Iterator[Log]:
    """A store with a broker serving it on loopback, in this process; with
    ``bookie_endpoints``, every bookie also serves its ledgers (``Log.endpoints``)."""
    from tierstream.broker.run import serve_bookies

    opts = {"dataDir": str(data_dir), "fsync": False, "deletionLag": "1h",
            "tierCheckInterval": "1h", **options}
    store = Store(StoreConfig.from_options(opts))
    broker = Broker(store, port=0)
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    endpoints = serve_bookies(store, "127.0.0.1", None, None, None, None) \
        if bookie_endpoints else []
    try:
        yield Log(store, broker, broker.url, data_dir, endpoints)
    finally:
        store.closing.set()
        broker.shutdown()
        for endpoint in endpoints:
            endpoint.shutdown()
        store.close()


def append(store: Store, partition: int, values: list[str], *, keys: list[str | None],
           times: list[int | None], topic: str = TOPIC) -> None:
    store.partition(topic, partition).append(as_produce_batch(pa.record_batch({
        "key": pa.array(keys, pa.string()), "value": [v.encode() for v in values],
        "publish_time": pa.array(times, pa.int64())})), producer=None, sequence_id=None)


def fill(log: Log, *, partitions: int, batches: int, n: int = 50, keys: int = 13) -> int:
    """Create TOPIC and append ``batches`` rounds of ``n`` messages to every partition:
    values ``"<partition>-<i>"``, keys ``k<i % keys>``, one second apart. Returns the count."""
    log.store.create_topic(TOPIC, partitions)
    i = 0
    for _ in range(batches):
        for p in range(partitions):
            append(log.store, p, [f"{p}-{i + j}" for j in range(n)],
                   keys=[f"k{(i + j) % keys}" for j in range(n)],
                   times=[BASE + (i + j) * 1000 for j in range(n)])
            i += n
    return i
