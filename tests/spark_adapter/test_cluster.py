"""A real Spark standalone cluster whose worker cannot see the store's files.

Master and worker are started from pyspark's own jars on loopback. The worker (and so every
executor) runs in a Linux mount namespace in which a tmpfs hides the store's data directory:
the stand-in for another host. The broker runs with 3 bookies (wq3/aq2), each serving its
ledgers on an endpoint, and a tier on S3 (moto). Reads:

(a) a backfill with the driver on the store's host (marked chaos: ``make chaos`` runs it;
    (b) reads the same splits the same way, planned through the broker instead);
(b) a backfill with the driver hidden from the data directory too (the broker URL only);
(c) a streaming AvailableNow read from that remote driver.

Each returns exactly the produced rows, and the per-path counts show bookie-log splits
served by bookie endpoints, never local files (hidden) nor the broker.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client.admin import Admin
from tierstream.client.producer import Producer

from ..spark_jvm import JAVA_OPTIONS
from ..timing import scaled

pytestmark = [pytest.mark.slow, pytest.mark.s3]

TOPIC = "acme/web/clicks"


def _why_no_namespace(probe: Path) -> str | None:
    """None when this process may hide a directory in a mount namespace, else why not."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs '{probe}'"],
                          capture_output=True, text=True, timeout=scaled(30))
    if proc.returncode != 0:
        return f"unshare -m with a tmpfs mount is not permitted here: {proc.stderr.strip()}"
    return None


def hidden(data_dir: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run in a new mount namespace where an empty tmpfs covers ``data_dir``."""
    return ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"',
            str(data_dir), *cmd]


class _Java:
    """A JVM process from pyspark's jars; waits for a line of its log."""

    def __init__(self, cmd: list[str], env: dict[str, str], ready: str, what: str) -> None:
        self.lines: list[str] = []
        self.what = what
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self._found = threading.Event()
        self.match: re.Match[str] | None = None
        pattern = re.compile(ready)

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = pattern.search(line)
                if m and not self._found.is_set():
                    self.match = m
                    self._found.set()

        threading.Thread(target=pump, daemon=True).start()

    def wait(self, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while not self._found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.what} did not start:\n" + "".join(self.lines[-40:]))
        assert self.match is not None
        return self.match

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def cluster(tmp_path: Path, s3_bucket: str) -> Iterator[tuple[str, Path]]:
    """(master URL, hidden data directory): a master, and a worker that cannot see it."""
    import pyspark

    why = _why_no_namespace(tmp_path / "probe")
    if why is not None:
        pytest.skip(why)
    home = os.path.dirname(pyspark.__file__)
    java = [shutil.which("java") or "java", "-Xmx512m", *JAVA_OPTIONS.split(), "-cp",
            os.path.join(home, "jars", "*")]  # short-lived JVMs, as the suite's drivers
    (scala,) = [re.match(r"scala-library-(\d+\.\d+)", p.name).group(1)  # type: ignore[union-attr]
                for p in Path(home, "jars").glob("scala-library-*.jar")]
    # the worker's launcher finds the jars of a pip-installed Spark only when told the Scala
    # version (otherwise it looks for a source build's directories)
    env = {**os.environ, "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_SCALA_VERSION": scala, "PYSPARK_PYTHON": sys.executable}
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    master = _Java([*java, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", "0", "--webui-port", "0"], env,
                   r"Starting Spark master at (spark://\S+)", "the Spark master")
    worker = None
    try:
        url = master.wait().group(1)
        work = tmp_path / "spark-work"
        worker = _Java(hidden(data_dir, [
            *java, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
            "--webui-port", "0", "--cores", "2", "--memory", "1g", "--work-dir", str(work),
            url]), env, r"Successfully registered with master", "the Spark worker")
        worker.wait()
        yield url, data_dir
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


def _produce(broker: str, start: int, count: int) -> None:
    with Producer(TOPIC, broker=broker) as producer:
        producer.send_many({"value": f"v{i}", "key": f"k{i % 37}"}
                           for i in range(start, start + count))


def _driver(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(400))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _paths(stderr: str) -> str:
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("read paths:")]
    return line


def _values(out: Path) -> list[str]:
    table = ds.dataset(str(out), format="parquet").to_table(columns=["value"])
    return sorted(bytes(v).decode() for v in table.column("value").to_pylist())


@dataclass
class _Store:
    """A broker whose data directory the cluster's worker cannot see, with ``expected``
    produced: bookie segments closed and open, and tier files on S3."""

    broker: str
    data_dir: Path
    env: dict[str, str]  # a driver's, with the cluster as its master
    expected: list[str]

    def backfill(self, out: Path) -> list[str]:
        return [sys.executable, "-m", "tierstream", "backfill", TOPIC, "--broker", self.broker,
                "--data-dir", str(self.data_dir), "--max-split-bytes", "1KiB",
                "--out", str(out)]


@pytest.fixture
def store(cluster: tuple[str, Path], s3_bucket: str, moto_endpoint: str) -> Iterator[_Store]:
    master, data_dir = cluster
    broker = BrokerProcess(data_dir, args=[
        "--bookies", "3", "--write-quorum", "3", "--ack-quorum", "2",
        "--max-entries-per-segment", "4", "--tier-url", f"s3://{s3_bucket}/tier",
        "--s3-endpoint", moto_endpoint, "--deletion-lag", "1h", "--no-fsync"])
    broker.start()
    try:
        assert broker.url is not None
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 2)
            for i in range(6):  # several entries of 40 messages per partition
                _produce(broker.url, i * 40, 40)
            assert admin.offload(TOPIC)  # these segments go to the tier (S3)
            for i in range(6, 14):
                _produce(broker.url, i * 40, 40)  # closed bookie segments and open ones
            endpoints = admin.bookie_endpoints()
        assert sorted(endpoints) == ["bookie-0", "bookie-1", "bookie-2"]
        env = {**os.environ, "TIERSTREAM_SPARK_MASTER": master, "SPARK_LOCAL_IP": "127.0.0.1",
               "PYSPARK_PYTHON": sys.executable, "TIERSTREAM_S3_ENDPOINT": moto_endpoint}
        yield _Store(broker.url, data_dir, env, sorted(f"v{i}" for i in range(14 * 40)))
    finally:
        broker.kill()


def test_reads_on_a_spark_cluster_whose_worker_cannot_see_the_store(
        store: _Store, tmp_path: Path) -> None:
    """The driver on another host too (planning through the broker): a backfill, then a
    streaming AvailableNow read."""
    out_b = tmp_path / "out-b"
    proc = _driver(hidden(store.data_dir, store.backfill(out_b)), store.env)
    assert "bookie-log: " in proc.stdout and "parquet-tier: " in proc.stdout \
        and "tail-consumer: " in proc.stdout, proc.stdout
    assert _values(out_b) == store.expected
    paths = _paths(proc.stderr)
    assert "bookie-log via bookie endpoint" in paths, paths
    assert "local file" not in paths and "broker fallback" not in paths, paths
    assert "parquet-tier via object store" in paths, paths

    out_c, ckpt = tmp_path / "out-c", tmp_path / "ckpt"
    _driver(hidden(store.data_dir, [
        sys.executable, "-m", "tierstream", "tail", TOPIC, "--broker", store.broker,
        "--data-dir", str(store.data_dir), "--from", "earliest", "--available-now",
        "--out", str(out_c), "--checkpoint", str(ckpt)]), store.env)
    assert _values(out_c) == store.expected


@pytest.mark.chaos  # a third driver run on the cluster; make chaos runs it
def test_a_driver_on_the_store_s_host_reads_on_a_spark_cluster_whose_worker_cannot_see_it(
        store: _Store, tmp_path: Path) -> None:
    """The driver plans from the data directory it sees; the executors, which do not see it,
    still read every closed segment from a bookie endpoint, never the broker."""
    out_a = tmp_path / "out-a"
    proc = _driver(store.backfill(out_a), store.env)
    assert "bookie-log: " in proc.stdout and "parquet-tier: " in proc.stdout \
        and "tail-consumer: " in proc.stdout, proc.stdout
    assert _values(out_a) == store.expected
    paths = _paths(proc.stderr)
    assert "bookie-log via bookie endpoint" in paths, paths
    assert "bookie-log via local file" not in paths and "broker fallback" not in paths
    assert "parquet-tier via object store" in paths, paths
