"""A subscription of a partition that was let go and is served again as a new log delivers
from the new log.

Regression (issue 74, the cluster flake): a key_shared consumer received nothing more after
PostgreSQL came back (450 acknowledged messages never delivered, the consumer attached with
permits and nothing unacknowledged). An acknowledgement that passed its ownership check just
before the broker's lease lapsed loaded the subscription again on the partition's log that
was being let go; that dispatcher's reader ended at once, and when the partition was served
again as a new log, consumers were attached to it for good."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tierstream.broker.topics.recovery import recover_open_segments
from tierstream.client import Admin, Consumer, Producer
from tierstream.metadata.owner_rows import Owner
from tierstream.model.positions import Offset
from tierstream.util.timeutil import now_ms

from ..logs import running_log
from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/reload/events"


def test_a_partition_served_again_as_a_new_log_delivers_to_its_subscription(
        tmp_path: Path) -> None:
    with running_log(tmp_path / "data") as log:
        store, registry = log.store, log.broker.subscriptions
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=log.url) as producer:
            producer.send_many({"key": f"k{i % 3}", "value": f"before{i}"} for i in range(5))
        with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(),
                      broker=log.url) as consumer:
            first = consumer.receive(timeout=scaled(30))
            assert first is not None and first.num_rows > 0
        # the lease lapsed: the partition is let go (on_lost: its log lost, dispatchers
        # stopped) ...
        store.owners.note(given={(TOPIC, 0): Owner("another-broker", 0, now_ms())})
        # ... and an acknowledgement that had passed its ownership check a moment before
        # loads the subscription again, on the log being let go
        none = np.array([], dtype=np.int64)
        registry.ack(TOPIC, "audit", 0, "late", none, none, none.astype(np.int32))
        # the lease is renewed: the partition is served again, as a new log, its open
        # segment recovered first (cluster.py)
        recover_open_segments(store.metadata, store.bookies, ack_quorum=store.ack_quorum,
                              partitions={(TOPIC, 0)})
        with store.topics_lock:
            opened = store.metadata.new_segments(TOPIC, [(0, store.choose_ensemble())],
                                                 created_at=now_ms())
            store.open_partitions(store.topic(TOPIC), opened)
        store.owners.note(gained=[(TOPIC, 0)])
        with Producer(TOPIC, broker=log.url) as producer:
            producer.send_many({"key": f"k{i % 3}", "value": f"after{i}"} for i in range(5))
        got: list[str] = []
        with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(),
                      broker=log.url) as consumer:
            def received() -> bool:
                batch = consumer.receive(timeout=0.2)
                if batch is not None:
                    got.extend(bytes(v).decode() for v in batch.column("value").to_pylist())
                    consumer.ack(batch)
                return {f"after{i}" for i in range(5)} <= set(got)
            wait_for(received, timeout=scaled(30),
                     what="the consumer to receive what the new log holds")
        assert {f"before{i}" for i in range(5)} <= set(got)  # none was acknowledged
