"""The sink: Spark batch and streaming writes into topics, exactly once (spark_adapter/sink.py).

A read-process-write query from topic A to topic B is SIGKILLed at random points while A is
produced and restarted from its checkpoint; task attempts fail after staging rows. B must equal
A transformed: nothing lost, nothing twice, each key's order kept.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tierstream.client import Admin, Producer
from tierstream.util.faults import ENV

from ..logs import SPARK_KILLS, running_log
from ..store.helpers import read_all, wait_for
from ..timing import scaled

pytestmark = [pytest.mark.spark]
ROOT = Path(__file__).resolve().parents[2]
SOURCE, SINK = "acme/etl/raw", "acme/etl/upper"


def _job(log: Any, checkpoint: Path, mode: str, master: str = "local[2]",
         crash_at: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "TIERSTREAM_SPARK_MASTER": master}
    if crash_at is not None:
        env[ENV] = crash_at
    return subprocess.Popen(
        [sys.executable, "-m", "tests.spark_adapter.sink_job", str(log.data_dir), log.url,
         SOURCE, SINK, str(checkpoint), mode], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([f for f in commits.iterdir() if f.name.isdigit()]) if commits.exists() else 0


def _per_key(table: pa.Table) -> dict[str, list[str]]:
    """Each key's values in log order (partition, then position: a key is in one partition)."""
    rows = sorted(zip(table.column("partition").to_pylist(), table.column("segment_id")
                      .to_pylist(), table.column("entry_id").to_pylist(),
                      table.column("batch_index").to_pylist(), table.column("key").to_pylist(),
                      table.column("value").to_pylist(), strict=True))
    out: dict[str, list[str]] = defaultdict(list)
    for *_, key, value in rows:
        out[key].append(bytes(value).decode())
    return out


def _check_exactly_once(log: Any) -> int:
    source, sink = read_all(log.url, SOURCE), read_all(log.url, SINK)
    want = {k: [v.upper() for v in vs] for k, vs in _per_key(source).items()}
    got = _per_key(sink)
    lost = sum(len(v) for v in want.values()) - sum(len(v) for v in got.values())
    assert sink.num_rows == len({bytes(v) for v in sink.column("value").to_pylist()}), (
        "a row was written twice")
    assert got == want, f"sink differs from the source uppercased ({lost} rows fewer)"
    return int(sink.num_rows)


@pytest.mark.slow
def test_a_read_process_write_query_killed_repeatedly_writes_each_row_once(tmp_path) -> None:
    rng = random.Random(20261122)
    with running_log(tmp_path / "data", maxEntriesPerSegment=8) as log:
        with Admin(log.url) as admin:
            admin.create_topic(SOURCE, 3)
            admin.create_topic(SINK, 2)
        stop = threading.Event()

        def produce() -> None:
            with Producer(SOURCE, broker=log.url, batch_size=20, name="writer") as producer:
                i = 0
                while not stop.is_set() and i < 20_000:
                    producer.send_many({"value": f"m{i + j}".encode(), "key": f"k{(i + j) % 11}"}
                                       for j in range(20))
                    i += 20
                    stop.wait(0.01)  # pacing the load, not synchronisation

        writer = threading.Thread(target=produce)
        writer.start()
        checkpoint = tmp_path / "ckpt"
        kills: list[int] = []
        try:
            while len(kills) < SPARK_KILLS:
                job = _job(log, checkpoint, "run")
                before = _committed_batches(checkpoint)
                wait = rng.randint(1, 2)
                wait_for(lambda b=before, w=wait, j=job: _committed_batches(checkpoint) >= b + w
                         or j.poll() is not None, timeout=scaled(180),
                         what="the query to commit micro-batches")
                assert job.poll() is None, f"the job died on its own: {job.stderr.read()[-3000:]}"
                time.sleep(rng.random() * 0.3)  # a random point inside the next batch
                job.kill()
                kills.append(job.wait())
            # and once right after the sink's commit, before Spark records the batch as
            # done: the restarted query runs that batch again, which must write nothing
            job = _job(log, checkpoint, "run", crash_at="sink.committed@1")
            _, err = job.communicate(timeout=scaled(180))
            assert job.returncode != 0, err[-3000:]
            query_id = json.loads((checkpoint / "metadata").read_text())["id"]
            with Admin(log.url) as admin:  # the broker has one batch more than Spark's log
                assert admin.last_committed_batch(query_id) == max(
                    int(f.name) for f in (checkpoint / "commits").iterdir()
                    if f.name.isdigit()) + 1, err[-3000:]
        finally:
            stop.set()
            writer.join()
        final = _job(log, checkpoint, "available-now")
        _, err = final.communicate(timeout=scaled(300))
        assert final.returncode == 0, err[-3000:]
        assert kills == [-signal.SIGKILL] * SPARK_KILLS, kills
        written = _check_exactly_once(log)
        assert written == read_all(log.url, SOURCE).num_rows > 0
        # what killed drivers left staged was fenced by the re-run of its batch, or is open
        # until the timeout: none of it is visible (checked above), none is applied twice
        with Admin(log.url) as admin:
            states = [t["state"] for t in admin.transactions()]
        assert "COMMITTED" not in states


def test_task_attempts_that_fail_after_staging_write_nothing_twice(tmp_path) -> None:
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(SOURCE, 2)
            admin.create_topic(SINK, 3)
        with Producer(SOURCE, broker=log.url, batch_size=50) as producer:
            producer.send_many({"value": f"v{i}".encode(), "key": f"k{i % 13}"}
                               for i in range(1000))
        job = _job(log, tmp_path / "ckpt", "flaky", master="local[2,3]")
        _, err = job.communicate(timeout=scaled(300))
        assert job.returncode == 0, err[-3000:]
        assert "injected" in err  # first attempts did fail
        assert _check_exactly_once(log) == 1000
        with Admin(log.url) as admin:
            states = [t["state"] for t in admin.transactions()]
        # Spark hands a task's rows to the sink only once its Python UDF has run over the
        # whole partition, so a failed attempt stages nothing here (staged-then-failed
        # attempts are fenced: tests/store/test_transactions.py)
        assert set(states) <= {"APPLIED", "ABORTED"}


def test_batch_writes_route_by_topic_column_and_rerun_idempotently(spark, tmp_path) -> None:
    from tierstream.spark_adapter import register

    register(spark)
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(SOURCE, 2)
            admin.create_topic(SINK, 3)
        df = spark.createDataFrame(
            [(SOURCE if i % 3 else SINK, f"k{i % 5}", f"v{i}", {"n": str(i)})
             for i in range(300)], "topic string, key string, value string, "
                                   "properties map<string,string>")
        for _ in range(2):  # the same job twice: sinkId + batchId write it once
            df.write.format("tierstream").mode("append").option("broker", log.url) \
                .option("sinkId", "daily-load").option("batchId", "20261122").save()
        source, sink = read_all(log.url, SOURCE), read_all(log.url, SINK)
        assert source.num_rows == 200 and sink.num_rows == 100
        row = sink.to_pylist()[0]
        assert dict(row["properties"])["n"] == row["value"].decode()[1:]
        with Admin(log.url) as admin:
            assert admin.last_committed_batch("daily-load") == 20261122
        # a plain write (no sinkId) is its own sink: writing twice writes twice
        df.limit(10).write.format("tierstream").mode("append").option("broker", log.url).save()
        assert read_all(log.url, SOURCE).num_rows + read_all(log.url, SINK).num_rows == 310


@pytest.mark.parametrize(("change", "error"), [
    (lambda df: df.withColumn("extra", df.value), "has no column 'extra'"),
    (lambda df: df.selectExpr("cast(1 as int) as value"), "column 'value' is int"),
    (lambda df: df.selectExpr("key"), "needs a 'value' column"),
    (lambda df: df.selectExpr("value", "1 as event_time"), "column 'event_time' is int"),
])
def test_bad_columns_fail_when_the_write_starts_naming_them(spark, tmp_path, change,
                                                            error) -> None:
    from tierstream.spark_adapter import register

    register(spark)
    df = spark.createDataFrame([("k", "v")], "key string, value string")
    with pytest.raises(Exception, match=error):
        change(df).write.format("tierstream").mode("append").option("topic", SINK) \
            .option("broker", "grpc://127.0.0.1:1").save()


def test_overwrite_and_missing_topic_are_refused(spark) -> None:
    from tierstream.spark_adapter import register

    register(spark)
    df = spark.createDataFrame([("k", "v")], "key string, value string")
    with pytest.raises(Exception, match="append-only"):
        df.write.format("tierstream").mode("overwrite").option("topic", SINK).save()
    with pytest.raises(Exception, match="needs option 'topic' or a 'topic' column"):
        df.write.format("tierstream").mode("append").save()
    with pytest.raises(Exception, match="'batchId' needs option 'sinkId'"):
        df.write.format("tierstream").mode("append").option("topic", SINK) \
            .option("batchId", "1").save()


def test_a_named_query_reads_and_writes_with_spark_s_own_options(spark, tmp_path) -> None:
    """``.queryName()``, ``checkpointLocation`` and ``load(path)``/``save(path)`` are options
    Spark itself hands the source and the sink: accepted (the path names the topic), while a
    user's typo is still refused naming the nearest option."""
    from tierstream.spark_adapter import register

    register(spark)
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(SOURCE, 2)
            admin.create_topic(SINK, 2)
        with Producer(SOURCE, broker=log.url) as producer:
            producer.send_many({"value": f"v{i}".encode(), "key": f"k{i % 7}"}
                               for i in range(200))
        raw = (spark.readStream.format("tierstream").option("broker", log.url)
               .option("dataDir", str(log.data_dir)).option("startingPosition", "earliest")
               .load(SOURCE))  # the path is the topic
        query = (raw.selectExpr("key", "upper(cast(value as string)) as value")
                 .writeStream.format("tierstream").option("topic", SINK)
                 .option("broker", log.url)
                 .option("checkpointLocation", str(tmp_path / "ckpt")).queryName("upper")
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        assert query.exception() is None
        assert read_all(log.url, SINK).num_rows == 200
        # a batch read and a batch write through the path
        back = spark.read.format("tierstream").option("broker", log.url) \
            .option("dataDir", str(log.data_dir)).load(SINK)
        assert back.count() == 200
        back.select("key", "value").limit(5).write.format("tierstream").mode("append") \
            .option("broker", log.url).save(SOURCE)
        assert read_all(log.url, SOURCE).num_rows == 205
        typo = (raw.writeStream.format("tierstream").option("topicc", SINK)
                .option("checkpointLocation", str(tmp_path / "ckpt2")).queryName("typo")
                .trigger(availableNow=True).start())
        with pytest.raises(Exception, match="unknown option 'topicc'; did you mean 'topic'"):
            typo.awaitTermination()  # Spark makes a stream's writer when the query starts
        with pytest.raises(Exception, match="name different topics"):
            spark.read.format("tierstream").option("topic", SINK).load(SOURCE)


def test_a_missing_topic_fails_when_the_write_starts_in_one_line(spark, tmp_path) -> None:
    from tierstream.spark_adapter import register

    register(spark)
    with running_log(tmp_path / "data") as log:
        df = spark.createDataFrame([("k", "v")], "key string, value string")
        with pytest.raises(Exception) as caught:
            df.write.format("tierstream").mode("append").option("broker", log.url) \
                .option("topic", "acme/etl/missing").save()
        assert "topic 'acme/etl/missing' does not exist" in str(caught.value)
        # refused while Spark made the writer on the driver, not from a task's Python worker
        assert "Failed to initialize Python data source writer" in str(caught.value)
        assert type(caught.value).__name__ == "AnalysisException"
