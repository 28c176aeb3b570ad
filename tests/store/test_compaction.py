"""Compacted topics: the compactor's snapshots and ``read(compacted=True)`` against an oracle
(the fold of the whole log: per partition and key the last message, a tombstone removing
its key, messages without a key left out), with the compactor killed between its steps."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.util.faults import ENV

from ..cli.test_cli import run
from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/prices/latest"


def _write(broker: BrokerProcess, rng: random.Random, n: int, start: int) -> None:
    """``n`` messages over 40 keys: about one in eight a tombstone, one in twenty keyless."""
    rows: list[dict[str, Any]] = []
    for i in range(start, start + n):
        roll = rng.random()
        key = None if roll < 0.05 else f"k{rng.randrange(40)}"
        value = b"" if 0.05 <= roll < 0.17 else f"v{i}".encode()
        rows.append({"key": key, "value": value})
    with Producer(TOPIC, broker=broker.url, batch_size=rng.choice([1, 7, 50])) as producer:
        producer.send_many(rows)


def _oracle(broker: BrokerProcess) -> dict[tuple[int, str], tuple[Any, ...]]:
    """The fold of the whole log, from a plain read."""
    log = tierstream.read(TOPIC, broker=broker.url).sort_by(
        [("partition", "ascending"), ("segment_id", "ascending"), ("entry_id", "ascending"),
         ("batch_index", "ascending")]).to_pylist()
    view: dict[tuple[int, str], tuple[Any, ...]] = {}
    for r in log:
        if r["key"] is None:
            continue
        if r["value"]:
            view[(r["partition"], r["key"])] = _ident(r)
        else:
            view.pop((r["partition"], r["key"]), None)
    return view


def _ident(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["value"], r["segment_id"], r["entry_id"], r["batch_index"], r["publish_time"])


def _compacted(broker: BrokerProcess) -> dict[tuple[int, str], tuple[Any, ...]]:
    rows = tierstream.read(TOPIC, broker=broker.url, compacted=True).to_pylist()
    view = {(r["partition"], r["key"]): _ident(r) for r in rows}
    assert len(view) == len(rows), "a key twice in one partition's compacted view"
    return view


def test_the_compacted_view_is_the_fold_of_the_log_at_every_horizon(
        start_broker: Callable[..., BrokerProcess]) -> None:
    rng = random.Random(76)
    broker = start_broker("--max-entries-per-segment", "5")
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        assert admin.compaction(TOPIC)["status"] == "NOT_RUN"
        written = 0
        for _ in range(5):
            n = rng.randrange(50, 400)
            _write(broker, rng, n, written)
            written += n
            if rng.random() < 0.7:
                status = admin.compact(TOPIC)
                assert status["status"] == "SUCCESS", status
                snaps = status["snapshots"]
                assert {s["partition"] for s in snaps} == {0, 1}
            assert _compacted(broker) == _oracle(broker)
        status = admin.compact(TOPIC)
        before = {s["partition"]: s["url"] for s in status["snapshots"]}
        status = admin.compact(TOPIC)  # nothing new: the same snapshots
        assert {s["partition"]: s["url"] for s in status["snapshots"]} == before
    # ids and publish times are the originals: equal to the plain read's, compared above


def test_a_compactor_killed_between_its_steps_leaves_a_valid_view(
        start_broker: Callable[..., BrokerProcess], free_port: int) -> None:
    rng = random.Random(7)
    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
        _write(broker, rng, 300, 0)
        assert admin.compact(TOPIC)["status"] == "SUCCESS"
    expected = _oracle(broker)
    written = 300
    for point in ("compaction.written", "compaction.saved"):
        broker.stop()
        broker = start_broker(port=free_port, env={ENV: point})
        _write(broker, rng, 200, written)
        written += 200
        with Admin(broker.url) as admin, pytest.raises(tierstream.TierstreamError):
            admin.compact(TOPIC)  # the broker dies in the call
        proc = broker.proc
        assert proc is not None
        wait_for(lambda: proc.poll() is not None, timeout=scaled(30),  # noqa: B023
                 what=f"the broker to die at {point}")
        broker = start_broker(port=free_port)
        expected = _oracle(broker)
        assert _compacted(broker) == expected, point
        with Admin(broker.url) as admin:
            assert admin.compact(TOPIC)["status"] == "SUCCESS"
        assert _compacted(broker) == expected, point


def test_compact_on_the_command_line(broker: BrokerProcess, tmp_path: Path) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    _write(broker, random.Random(1), 100, 0)
    done = run("topic", "compact", TOPIC, "--wait", "--broker", broker.url)
    assert done.returncode == 0, done.stderr
    keys = len(_oracle(broker))
    assert f"partition 0: {keys:,} live key(s)" in done.stdout, done.stdout
    status = run("topic", "compaction", TOPIC, "--broker", broker.url)
    assert status.returncode == 0 and f"{TOPIC}: SUCCESS" in status.stdout, status
    out = tmp_path / "latest.parquet"
    read = run("read", TOPIC, "--compacted", "--out", str(out), "--broker", broker.url,
               "--data-dir", str(broker.data_dir))
    assert read.returncode == 0, read.stderr
    rows = pq.read_table(out).to_pylist()
    assert {(r["partition"], r["key"]): r["value"] for r in rows} == {
        k: v[0] for k, v in _oracle(broker).items()}
    assert f"wrote {len(rows):,} live key(s)" in read.stderr
    import datetime as dt

    until = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cut = run("read", TOPIC, "--compacted", "--to", until, "--out", str(tmp_path / "to.parquet"),
              "--broker", broker.url, "--data-dir", str(broker.data_dir))
    assert cut.returncode == 0 and "the log up to there is read and folded" in cut.stderr, cut
    assert pq.read_table(tmp_path / "to.parquet").num_rows == len(rows)
    refused = run("read", TOPIC, "--compacted", "--from", "latest", "--out",
                  str(tmp_path / "no.parquet"), "--broker", broker.url)
    assert refused.returncode != 0 and "--compacted" in refused.stderr, refused
    assert not (tmp_path / "no.parquet").exists()
    wrong = run("topic", "compact", "acme/prices/nothing", "--broker", broker.url)
    assert wrong.returncode != 0 and "acme/prices/nothing" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_a_topic_with_a_threshold_is_compacted_once_that_much_is_written(
        start_broker: Callable[..., BrokerProcess]) -> None:
    broker = start_broker("--tier-check-interval", "1s")
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    wrong = run("topic", "set", TOPIC, "--compaction-threshold", "lots", "--broker", broker.url)
    assert wrong.returncode != 0 and "--compaction-threshold" in wrong.stderr, wrong
    said = run("topic", "set", TOPIC, "--compaction-threshold", "20KB", "--broker", broker.url)
    assert said.returncode == 0 and "compacted whenever a partition has" in said.stdout, said
    _write(broker, random.Random(3), 100, 0)  # about 2 KB: under the threshold
    with Admin(broker.url) as admin:
        time.sleep(scaled(2))  # two policy passes
        assert admin.compaction(TOPIC)["snapshots"] == []
        _write(broker, random.Random(4), 2000, 100)

        def settled() -> bool:  # compacted, and not again: nothing written since
            status = admin.compaction(TOPIC)
            return (len(status["snapshots"]) == 1 and status["status"] == "SUCCESS"
                    and status["backlog_bytes"]["0"] < 20_000)

        wait_for(settled, timeout=scaled(30), what="the policy to compact the topic")
        runs = admin.compaction(TOPIC)["snapshots"][0]["compacted_at"]
        time.sleep(scaled(2))  # two policy passes more: under the threshold, no run
        assert admin.compaction(TOPIC)["snapshots"][0]["compacted_at"] == runs
        stats = admin.topic_stats(TOPIC)
        keys = admin.compaction(TOPIC)["snapshots"][0]["keys"]
    assert stats["compaction"]["threshold_bytes"] == 20_000
    assert stats["compaction"]["keys"] == keys
    shown = run("topic", "stats", TOPIC, "--broker", broker.url)
    assert f"compacted: {keys:,} live key(s)" in shown.stdout, shown.stdout
    assert _compacted(broker) == _oracle(broker)


def test_a_replaced_snapshot_file_stays_for_the_deletion_lag_then_goes(
        start_broker: Callable[..., BrokerProcess], data_dir: Path) -> None:
    rng = random.Random(4)
    broker = start_broker()  # the default lag: ten minutes
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    urls = []
    for run_ in range(3):
        _write(broker, rng, 50, 50 * run_)
        with Admin(broker.url) as admin:
            urls.append(admin.compact(TOPIC)["snapshots"][0]["url"])
    files = sorted(data_dir.rglob("compacted/partition-0/*.parquet"))
    assert len(files) == 3, files  # a reader planned on the first may still be reading it
    broker.stop()
    broker = start_broker("--deletion-lag", "0s")
    _write(broker, rng, 50, 150)
    with Admin(broker.url) as admin:
        urls.append(admin.compact(TOPIC)["snapshots"][0]["url"])
    left = sorted(p.name for p in data_dir.rglob("compacted/partition-0/*.parquet"))
    assert left == sorted(u.rsplit("/", 1)[1] for u in urls[-2:])  # current and previous
    assert _compacted(broker) == _oracle(broker)
