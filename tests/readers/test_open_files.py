"""A read over many more segments than a process may open files holds no descriptor per
segment (issue 80).

Regression: ``tierstream.read`` of a window of 1,000 segments read from local bookie files
returned a table that kept one memory-mapped ledger file, and its descriptor, per segment
(Python's ``mmap`` keeps a duplicate of the file's descriptor for as long as the mapping), so
a process with the usual limit of 1,024 open files failed with "Too many open files" past
about 1,000 segments. The mappings now hold no descriptor (``util/mapped.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin
from tierstream.model.message_format import as_produce_batch

from ..store.test_tier import TOPIC, make_store

SEGMENTS = 1000  # a ledger file each, four times LIMIT (5,000 cost 4x the CPU)
LIMIT = 256  # open files of the reading process: far fewer than the segments it reads

_READ = f"""
import os, sys, tierstream
data_dir, broker, how = sys.argv[1:4]
if how == "read":
    got = tierstream.read({TOPIC!r}, start="earliest", end="latest", data_dir=data_dir,
                          broker=broker)
    rows = got.num_rows
else:
    got = list(tierstream.scan({TOPIC!r}, start="earliest", end="latest", data_dir=data_dir,
                               broker=broker))
    rows = sum(b.num_rows for b in got)
held = [os.readlink(f"/proc/self/fd/{{f}}") for f in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{{f}}")]
print(rows, sum(path.endswith(".log") or path.endswith(".idx") for path in held))
"""


@pytest.fixture(scope="module")
def many_segments(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A topic of one partition in SEGMENTS sealed segments of two entries of one message."""
    data_dir = tmp_path_factory.mktemp("many-segments")
    store = make_store(data_dir, maxEntriesPerSegment=2)
    try:
        store.create_topic(TOPIC, 1)
        plog = store.partition(TOPIC, 0)
        for e in range(2 * SEGMENTS):
            plog.append(as_produce_batch(pa.record_batch({
                "key": [f"k{e % 7}"], "value": [f"v{e}".encode()],
                "publish_time": [1_700_000_000_000 + e]})), producer=None, sequence_id=None)
    finally:
        store.close()
    return data_dir


@pytest.mark.parametrize("how", ["read", "scan", "cli-read", "cli-consume"])
def test_a_read_of_more_segments_than_open_files_holds_no_descriptor_per_segment(
        many_segments: Path, how: str, tmp_path: Path) -> None:
    """The reading process and the broker serving it are both limited to LIMIT open files;
    ``cli-consume`` reads every segment through the broker (its reads share one descriptor
    per ledger file: ``bookie/open_files.py``)."""
    broker = BrokerProcess(many_segments, open_files=LIMIT).start()
    limited = ["prlimit", f"--nofile={LIMIT}:{LIMIT}", sys.executable]
    try:
        if how.startswith("cli-"):
            out = tmp_path / "r.parquet"
            at = ["--broker", str(broker.url)]
            done = subprocess.run(
                [*limited, "-m", "tierstream", "read", TOPIC, "--out", str(out), "--data-dir",
                 str(many_segments), *at] if how == "cli-read" else
                [*limited, "-m", "tierstream", "consume", TOPIC, "--to", "latest", *at],
                capture_output=True, text=True)
            rows = pq.read_metadata(out).num_rows if how == "cli-read" and \
                done.returncode == 0 else len(done.stdout.splitlines())
            ledger_files = 0
        else:
            done = subprocess.run([*limited, "-c", _READ, str(many_segments), str(broker.url),
                                   how], capture_output=True, text=True)
            rows, ledger_files = map(int, done.stdout.split() or (0, 0))
        stats = Admin(broker.url).stats()
    finally:
        broker.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    assert rows == 2 * SEGMENTS
    assert ledger_files == 0, f"{ledger_files} ledger files held open by what the read returned"
    assert all(b["read_files"] <= b["read_files_limit"] for b in stats["bookies"].values())


def _ledger_files_of_processes_below(pid: int) -> tuple[int, int]:
    """(ledger files open, Python workers of Spark) in the processes under ``pid`` (Spark's
    Python workers are children of its JVM, itself a child of this process)."""
    held = workers = 0
    for task in os.listdir("/proc"):
        if not task.isdigit():
            continue
        with contextlib.suppress(OSError):
            ancestors, at = set(), int(task)
            while at > 1 and at not in ancestors:
                ancestors.add(at)
                at = int(Path(f"/proc/{at}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid not in ancestors or int(task) == pid:
                continue
            workers += b"pyspark" in Path(f"/proc/{task}/cmdline").read_bytes()
            for fd in os.listdir(f"/proc/{task}/fd"):
                with contextlib.suppress(OSError):
                    held += os.readlink(f"/proc/{task}/fd/{fd}").endswith((".log", ".idx"))
    return held, workers


def test_a_spark_batch_read_of_many_segments_leaves_no_ledger_file_open(
        many_segments: Path, spark: Any) -> None:
    """The Spark source reads splits with the same readers in its Python workers (long-lived:
    Spark reuses them): after a batch read of every segment they hold no ledger file."""
    from tierstream.spark_adapter import register

    register(spark)
    broker = BrokerProcess(many_segments, open_files=LIMIT).start()
    try:
        frame = spark.read.format("tierstream").option("topic", TOPIC) \
            .option("dataDir", str(many_segments)).option("broker", str(broker.url)).load()
        assert frame.count() == 2 * SEGMENTS
    finally:
        broker.stop()
    held, workers = _ledger_files_of_processes_below(os.getpid())
    assert workers > 0, "no Python worker of Spark found: the check would see nothing"
    assert held == 0, f"{held} ledger files held open by Spark's Python workers"
