"""The compaction oracle: random keyed writes (tombstones, keyless messages), compactions at
random horizons, the broker SIGKILLed at a random moment of a run — after each round the
compacted view from every path (``tierstream.read(compacted=True)``, a Pulsar reader with
``is_read_compacted``, the client's TableView, Spark) equals the fold of the log, each key
under the id and publish time of its latest message.

Also: a compactor run while producers write and a compacted reader reads loses nothing and
shows no reader half a snapshot. ``TIERSTREAM_COMPACTION_ROUNDS`` (``make chaos``) runs more
rounds than the suite's few."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.spark_adapter import register

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of

TOPIC = "acme/prices/oracle"
ROUNDS = int(os.environ.get("TIERSTREAM_COMPACTION_ROUNDS", "4"))
View = dict[str, tuple[bytes, tuple[int, int, int], int]]


def _write(broker: BrokerProcess, rng: random.Random, n: int, start: int) -> None:
    rows: list[dict[str, Any]] = []
    for i in range(start, start + n):
        roll = rng.random()
        key = None if roll < 0.05 else f"k{rng.randrange(300)}"
        rows.append({"key": key, "value": b"" if 0.05 <= roll < 0.15 else f"v{i}".encode()})
    with Producer(TOPIC, broker=broker.url, batch_size=rng.choice([1, 20, 200])) as producer:
        producer.send_many(rows)


def _fold(broker: BrokerProcess) -> View:
    """The oracle: the whole log folded in position order."""
    view: View = {}
    for r in _log(broker):
        if r["key"] is None:
            continue
        if r["value"]:
            view[r["key"]] = _ident(r)
        else:
            view.pop(r["key"], None)
    return view


def _ident(r: dict[str, Any]) -> tuple[bytes, tuple[int, int, int], int]:
    publish_ms = r["publish_time"]
    if not isinstance(publish_ms, int):  # a timestamp column (Spark): back to milliseconds
        publish_ms = int(publish_ms.timestamp() * 1000 + 0.5)
    return (bytes(r["value"]), (r["segment_id"], r["entry_id"], r["batch_index"]), publish_ms)


def _read_compacted(broker: BrokerProcess) -> View:
    rows = tierstream.read(TOPIC, broker=broker.url, compacted=True).to_pylist()
    view = {r["key"]: _ident(r) for r in rows}
    assert len(view) == len(rows), "a key twice in the compacted read"
    return view


def _pulsar_reader(broker: BrokerProcess) -> View:
    """What a compacted Pulsar reader from the earliest message ends up holding per key."""
    import pulsar

    client = client_of(broker)
    try:
        reader = client.create_reader(f"persistent://{TOPIC}", pulsar.MessageId.earliest,
                                      is_read_compacted=True)
        view: View = {}
        while reader.has_message_available():
            msg = reader.read_next(timeout_millis=int(scaled(10_000)))
            key = msg.partition_key()
            if not key:
                continue
            mid = msg.message_id()
            if msg.data():
                view[key] = (msg.data(), (mid.ledger_id(), mid.entry_id(),
                                          max(mid.batch_index(), 0)), msg.publish_timestamp())
            else:
                view.pop(key, None)
        reader.close()
        return view
    finally:
        client.close()


def _table_view(broker: BrokerProcess, expected: View) -> None:
    client = client_of(broker)
    try:
        table = client.create_table_view(f"persistent://{TOPIC}")
        want = {k: v for k, (v, _, _) in expected.items()}

        def held() -> dict[str, bytes]:
            out: dict[str, bytes] = {}
            table.for_each(lambda k, v: out.__setitem__(k, v))
            return out

        wait_for(lambda: held() == want, timeout=scaled(20),
                 what="the TableView to hold the fold of the log")
        table.close()
    finally:
        client.close()


def _spark(spark: Any, broker: BrokerProcess) -> View:
    register(spark)
    rows = spark.read.format("tierstream").option("broker", broker.url) \
        .option("topic", TOPIC).option("compacted", "true").option("keyRanges", "3") \
        .load().collect()
    view = {r["key"]: _ident(r.asDict()) for r in rows}
    assert len(view) == len(rows), "a key twice in Spark's compacted read"
    return view


def _kill_during_a_run(broker: BrokerProcess, rng: random.Random, took_s: float) -> str:
    """Start a compaction and SIGKILL the broker at a random moment of about its length."""
    with Admin(broker.url) as admin:
        admin.compact(TOPIC, wait=False)
    delay = rng.uniform(0, took_s * 1.3)
    time.sleep(delay)
    broker.kill()
    return f"killed {delay * 1000:.0f} ms into a run of about {took_s * 1000:.0f} ms"


def test_every_path_reads_the_fold_of_the_log_through_compactions_and_kills(
        start_broker: Callable[..., BrokerProcess], free_port: int, spark: Any) -> None:
    seed = int(os.environ.get("TIERSTREAM_COMPACTION_SEED", "76"))
    rng = random.Random(seed)
    from ..ports import fixed_port

    args = ("--max-entries-per-segment", "30", "--pulsar-port", str(fixed_port()))
    broker = start_broker(*args, port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    written, took_s, history = 0, 0.05, []
    for round_ in range(ROUNDS):
        n = rng.randrange(1_000, 4_000)
        _write(broker, rng, n, written)
        written += n
        action = rng.choice(["compact", "kill", "kill", "none"])
        if action == "compact":
            with Admin(broker.url) as admin:
                status = admin.compact(TOPIC)
            assert status["status"] == "SUCCESS", status
            took_s = max(0.01, (status["finished_ms"] - status["started_ms"]) / 1000)
            history.append(f"round {round_}: +{n}, compacted in {took_s * 1000:.0f} ms")
        elif action == "kill":
            history.append(f"round {round_}: +{n}, "
                           + _kill_during_a_run(broker, rng, took_s))
            broker = start_broker(*args, port=free_port)
        else:
            history.append(f"round {round_}: +{n}, no compaction")
        expected = _fold(broker)
        what = f"seed {seed}; " + "; ".join(history)
        assert _read_compacted(broker) == expected, what
        got = _pulsar_reader(broker)
        assert got == expected, (what, "keys the Pulsar reader got wrong:", sorted(
            (v[1], k) for k, v in expected.items() if got.get(k) != v)[:10])
    _table_view(broker, expected)
    assert _spark(spark, broker) == expected, what
    with Admin(broker.url) as admin:  # a run after the last kill finds the view unchanged
        assert admin.compact(TOPIC)["status"] == "SUCCESS"
    assert _read_compacted(broker) == expected


def _log(broker: BrokerProcess) -> list[dict[str, Any]]:
    return tierstream.read(TOPIC, broker=broker.url).sort_by(
        [("segment_id", "ascending"), ("entry_id", "ascending"),
         ("batch_index", "ascending")]).to_pylist()


def _a_fold_of_a_prefix(view: View, log: list[dict[str, Any]],
                        index: dict[tuple[int, int, int], int]) -> int:
    """Where ``view`` cuts the log if it is the fold of a prefix of it (the index after its
    latest message); AssertionError if it is no such fold (half a snapshot, say)."""
    cut = max((index[pos] + 1 for _, pos, _ in view.values()), default=0)
    folded: dict[str, tuple[bytes, tuple[int, int, int], int]] = {}
    for r in log[:cut]:
        if r["key"] is not None:
            if r["value"]:
                folded[r["key"]] = _ident(r)
            else:
                folded.pop(r["key"], None)
    # past the cut, only tombstones and keyless messages until the next version
    gone = set()
    for r in log[cut:]:
        if r["key"] is not None and r["value"]:
            break
        if r["key"] is not None:
            gone.add(r["key"])
    assert all(folded.get(k) == v for k, v in view.items()), "a version no prefix holds"
    missing = set(folded) - set(view)
    assert missing <= gone, f"keys missing from the view: {sorted(missing)[:5]}"
    return cut


def test_a_compaction_beside_writers_and_a_reader_loses_nothing_and_shows_no_half_snapshot(
        start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker("--max-entries-per-segment", "30")
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    _write(broker, random.Random(3), 3_000, 0)
    stop = threading.Event()
    views: list[View] = []

    def writer(first: int) -> None:
        own = random.Random(first)
        i = first
        while not stop.is_set():
            _write(broker, own, 100, i)
            i += 100

    def reader() -> None:
        while not stop.is_set():
            views.append(_read_compacted(broker))

    threads = [threading.Thread(target=writer, args=(10_000_000 * (i + 1),)) for i in range(2)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    try:
        with Admin(broker.url) as admin:
            for _ in range(5):
                assert admin.compact(TOPIC)["status"] == "SUCCESS"
                time.sleep(scaled(0.1))
        # the reader read across the runs: a few views at least, however loaded the machine
        wait_for(lambda: len(views) >= 3, timeout=scaled(60), what="three compacted reads")
    finally:
        stop.set()
        for t in threads:
            t.join(scaled(60))
    log = _log(broker)
    index = {(r["segment_id"], r["entry_id"], r["batch_index"]): i for i, r in enumerate(log)}
    cuts = [_a_fold_of_a_prefix(v, log, index) for v in views]
    assert len(views) >= 3 and cuts == sorted(cuts), cuts  # each read at or after the last
    assert _read_compacted(broker) == _fold(broker)
