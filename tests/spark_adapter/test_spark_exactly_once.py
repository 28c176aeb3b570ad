"""Exactly-once restarts: a streaming query SIGKILLed at random points, restarted from its
checkpoint, while producers write; the output equals what was produced."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tierstream.client import Producer

from ..logs import SPARK_KILLS, TOPIC, running_log
from ..store.helpers import wait_for
from ..timing import scaled

#: make chaos only (8 kills): the suite's SIGKILLed read-process-write query
#: (test_sink.py) checks the same restarts — every source row written once — in short
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.chaos]
ROOT = Path(__file__).resolve().parents[2]


def _committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([f for f in commits.iterdir() if f.name.isdigit()]) if commits.exists() else 0


def _job(log: Any, out: Path, checkpoint: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TIERSTREAM_SPARK_MASTER": "local[2]"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.spark_adapter.stream_job", str(log.data_dir), log.url,
         str(out), str(checkpoint), mode], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)


def test_sigkilled_streaming_query_restarts_exactly_once(spark: Any, tmp_path: Path) -> None:
    rng = random.Random(20261121)
    with running_log(tmp_path / "data", maxEntriesPerSegment=4) as log:
        log.store.create_topic(TOPIC, 3)
        produced: list[str] = []
        stop = threading.Event()

        def produce() -> None:
            with Producer(TOPIC, broker=log.url, batch_size=25, name="writer") as producer:
                i = 0
                while not stop.is_set() and i < 20_000:
                    values = [f"m{i + j}" for j in range(25)]
                    producer.send_many({"value": v.encode(), "key": f"k{int(v[1:]) % 11}"}
                                       for v in values)
                    produced.extend(values)
                    i += 25
                    stop.wait(0.01)  # pacing the load, not synchronisation

        writer = threading.Thread(target=produce)
        writer.start()
        out, checkpoint = tmp_path / "out", tmp_path / "ckpt"
        kills: list[int] = []  # exit statuses of the killed jobs
        try:
            while len(kills) < SPARK_KILLS:
                job = _job(log, out, checkpoint, "run")
                before = _committed_batches(checkpoint)
                wait = rng.randint(1, 2)
                wait_for(lambda b=before, w=wait, j=job: _committed_batches(checkpoint) >= b + w
                         or j.poll() is not None, timeout=scaled(180),
                         what="the streaming query to commit micro-batches")
                assert job.poll() is None, "the streaming job died on its own"
                time.sleep(rng.random() * 0.3)  # a random point inside the next batch
                job.kill()
                kills.append(job.wait())
        finally:
            stop.set()
            writer.join()
        final = _job(log, out, checkpoint, "available-now")
        assert final.wait(timeout=scaled(300)) == 0
        rows = spark.read.parquet(str(out)).select("value").collect()
        got = sorted(bytes(r["value"]).decode() for r in rows)
        assert len(got) == len(set(got)), f"{len(got) - len(set(got))} duplicated"
        assert sorted(produced) == got, f"{len(set(produced) - set(got))} lost"
        assert kills == [-signal.SIGKILL] * SPARK_KILLS, kills  # each kill hit a live query
