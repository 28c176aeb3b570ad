"""Per-key order across scale events for the Python readers: ``read`` (planner chains,
with and without key ranges) and ``tail`` (a follower that discovers grown partitions),
on randomized logs written by concurrent named producers while the topic grows."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tierstream.client import Admin
from tierstream.runtime.local import plan, read, tail

from .elastic import check_tailed, grow_while_writing, order_errors
from .logs import running_log
from .store.helpers import wait_for
from .timing import scaled

TOPIC = "acme/web/elastic"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reads_and_tails_keep_each_keys_order_across_scale_events(tmp_path: Path,
                                                                  seed: int) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=4) as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1 + seed % 3)
        rows: list[Any] = []
        following = tail(TOPIC, start="earliest", key_ranges=2, **log.kw())
        written_all = threading.Event()

        def collect() -> None:  # a consumer that falls behind: the tail has a backlog
            for batch in following:  # in every partition when it learns of the events
                rows.append(batch.select(["key", "value"]))
                written_all.wait()

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        try:
            written = grow_while_writing(log.url, TOPIC, seed, create=False)
        finally:
            written_all.set()
        assert len(written.counts) >= 2
        check_tailed(written, rows, following)
        for key_ranges in (1, 3):
            table = read(TOPIC, key_ranges=key_ranges, **log.kw())
            assert order_errors(written, table.column("key").to_pylist(),
                                table.column("value").to_pylist()) == []


def test_a_read_after_the_event_keeps_its_parallelism(tmp_path: Path) -> None:
    """Grown partitions join their parent's chain only when the read holds the parent's
    data from before the event."""
    from tierstream.splits.split import StreamCut, chains

    with running_log(tmp_path / "data") as log:
        grow_while_writing(log.url, TOPIC, 7, events=1, messages=300)
        with Admin(log.url) as admin:
            event = admin.get_topic(TOPIC).scale_events[0]
        everything = list(plan(TOPIC, **log.kw()))
        before = {s.partition for s in everything if s.segment_id < event.first_segment_id}
        assert before
        for s in everything:  # joined to the parent's chain where the parent has data before
            parent = s.partition % event.old
            if s.partition >= event.old:
                assert s.chain == (parent if parent in before else None), s
            else:
                assert s.chain is None
        roots = len({s.chain if s.chain is not None else s.partition for s in everything})
        # key ranges still multiply the parallelism of a grown topic
        assert len(chains(list(plan(TOPIC, key_ranges=3, **log.kw())))) == 3 * roots
        cut = {p: event.boundary(p) for p in range(event.old)}
        later = plan(TOPIC, start=StreamCut.of(TOPIC, cut), **log.kw())
        assert later and all(s.chain is None for s in later)
        assert len(chains(list(later))) == len({s.partition for s in later})


def test_a_lagging_tail_hands_over_a_moved_keys_messages_after_its_earlier_ones(
        tmp_path: Path) -> None:
    """The follower learns of the event while its parent partition still has a backlog
    (the consumer fell behind): the grown partitions wait for it."""
    from tierstream.client import Producer

    from .elastic import Written

    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1)
        written = Written()
        following = tail(TOPIC, start="latest", **log.kw())  # "latest" is taken now
        rows: list[Any] = []
        resume = threading.Event()

        def collect() -> None:
            for batch in following:
                rows.append(batch.select(["key", "value"]))
                resume.wait()

        def send(producer: Producer, first: int, count: int) -> None:
            chunk = []
            for i in range(first, first + count):
                key = f"k{i % 11}"
                written.by_key[key].append(f"{key}|{i:07d}")
                chunk.append({"key": key, "value": f"{key}|{i:07d}"})
            producer.send_many(chunk)

        threading.Thread(target=collect, daemon=True).start()
        with Producer(TOPIC, name="w", batch_size=3, **{"broker": log.url}) as producer:
            send(producer, 0, 1)
            wait_for(lambda: len(rows) == 1, what="the tail to start")
            send(producer, 1, 1500)  # far more than the tail's queue holds
            with Admin(log.url) as admin:
                admin.set_partitions(TOPIC, 4)
            send(producer, 1501, 600)
        resume.set()
        check_tailed(written, rows, following)


@pytest.mark.parametrize("seed", [4, 5])
def test_key_shared_and_exclusive_subscriptions_keep_key_order_across_scale_events(
        tmp_path: Path, seed: int) -> None:
    """Consumers made before the events attach to the grown partitions themselves, and the
    broker hands a key's messages after an event only once its earlier ones are acked."""
    import random
    import time

    from tierstream.client import Consumer
    from tierstream.model.positions import Offset

    with running_log(tmp_path / "data", maxEntriesPerSegment=4) as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 1 + seed % 2)
        got: dict[str, list[tuple[str, bytes]]] = {"key_shared": [], "exclusive": []}
        lock = threading.Lock()
        stop = threading.Event()
        consumers = [Consumer(TOPIC, "ks", mode="key_shared", initial=Offset.earliest(),
                              receiver_queue_size=40, broker=log.url) for _ in range(3)]
        consumers.append(Consumer(TOPIC, "ex", initial=Offset.earliest(),
                                  receiver_queue_size=40, broker=log.url))
        errors: list[BaseException] = []

        def consume(c: Consumer, kind: str, r: random.Random) -> None:
            try:
                while not stop.is_set():
                    batch = c.receive(timeout=0.1)
                    if batch is None:
                        continue
                    with lock:
                        got[kind].extend(zip(batch.column("key").to_pylist(),
                                             batch.column("value").to_pylist(), strict=True))
                    time.sleep(r.random() * 0.02)  # a slow consumer: backlogs build up
                    c.ack(batch)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=consume, daemon=True, args=(
            c, "exclusive" if i == 3 else "key_shared", random.Random(seed * 10 + i)))
            for i, c in enumerate(consumers)]
        for t in threads:
            t.start()
        try:
            written = grow_while_writing(log.url, TOPIC, seed, messages=600, create=False)
            for kind in got:
                wait_for(lambda k=kind: len(got[k]) >= written.total, timeout=scaled(120),
                         what=f"the {kind} consumers to receive everything")
        finally:
            stop.set()
            for t in threads:
                t.join(scaled(30))
            for c in consumers:
                c.close()
        assert not errors, errors
        for kind, rows in got.items():
            keys, values = zip(*rows, strict=True)
            assert order_errors(written, keys, values) == [], kind


def test_cuts_on_both_sides_of_an_event_split_the_log_exactly(tmp_path: Path) -> None:
    """A cut taken before an event (without the grown partitions) and one taken after it:
    backfill to a cut, then tail from it, is exactly the log, each key in order."""
    from tierstream.runtime.local import latest_cut

    with running_log(tmp_path / "data", maxEntriesPerSegment=4) as log:
        written = grow_while_writing(log.url, TOPIC, 8, messages=300, events=1)
        before = latest_cut(TOPIC, **log.kw())  # all of it so far, 1 event in
        grow_while_writing(log.url, TOPIC, 9, messages=300, events=2, written=written,
                           create=False)
        after = latest_cut(TOPIC, **log.kw())
        assert len(after.partitions) > len(before.partitions)
        for cut in (before, after):
            head = read(TOPIC, end=cut, **log.kw())
            tailed = _tail_until(TOPIC, cut, written.total - head.num_rows, log)
            both = pa.Table.from_batches([*head.select(["key", "value"]).to_batches(),
                                          *tailed])
            assert order_errors(written, both.column("key").to_pylist(),
                                both.column("value").to_pylist()) == []


def _tail_until(topic: str, cut: Any, rows: int, log: Any) -> list[pa.RecordBatch]:
    """What ``tail(start=cut)`` hands over until it has ``rows`` rows."""
    got: list[pa.RecordBatch] = []
    following = tail(topic, start=cut, key_ranges=2, **log.kw())

    def collect() -> None:
        for batch in following:
            got.append(batch.select(["key", "value"]))

    threading.Thread(target=collect, daemon=True).start()
    try:
        wait_for(lambda: sum(b.num_rows for b in got) >= rows, timeout=scaled(60),
                 what="the tail to catch up")
    finally:
        following.close()
    return got
