"""Shared fixtures: real broker processes on loopback, on temporary data directories."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess

from . import forkserver, spark_jvm
from .postgres import PostgresServer, postgres_server
from .timing import scaled

#: Each test's limit (pytest-timeout, unless ``--timeout`` says otherwise); derived from the
#: suite's scale so that a loaded machine stretches it with every other deadline.
TEST_LIMIT_S = scaled(300)
#: After this, a test still running is hung where pytest-timeout's signal cannot reach it (the
#: main thread blocked in C, e.g. reading a Flight stream): the watchdog prints every thread's
#: stack and ends the worker, so the run fails with the place instead of hanging CI.
HANG_S = TEST_LIMIT_S + scaled(60)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("timeout", None) is None:
        config.option.timeout = TEST_LIMIT_S
    # xdist's workers start with COLUMNS=80, which every command run from a test would
    # inherit: the CLI follows COLUMNS, so a test that wants a width says it
    os.environ.pop("COLUMNS", None)
    spark_jvm.configure()  # every Spark of the suite: a JVM for short runs (spark_jvm.py)
    # reads of S3 tiers go through a tier cache (tier/cache.py): the suite's own, not the
    # user's ~/.cache, and gone with the run
    import tempfile

    os.environ.setdefault("TIERSTREAM_TIER_CACHE_DIR",
                          tempfile.mkdtemp(prefix="tierstream-test-tier-cache-"))
    # brokers and CLI commands forked from one process that imported tierstream once
    if os.environ.get("TIERSTREAM_TEST_SPAWN", "") in ("", "0"):
        forkserver.start()
        BrokerProcess.popen = forkserver.popen


def pytest_unconfigure(config: pytest.Config) -> None:
    BrokerProcess.popen = subprocess.Popen
    forkserver.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with ``slow`` tests first: under ``--dist loadfile`` (``make test``) a file of
    minutes that happens to come last would run alone at the end while the other worker idles.
    The sort is stable, so every file keeps its own order."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    watchdog = threading.Timer(HANG_S, _hung, args=(item,))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _hung(item: pytest.Item) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n{item.nodeid}: still running after {HANG_S:g}s, beyond the "
                     f"{TEST_LIMIT_S:g}s limit; the stacks of its threads:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(3)


#: A worker holding more descriptors than this after a test fails that test: past 1,024, the
#: py4j callback server of the worker's SparkSession (select()) stops answering and the next
#: foreachBatch query hangs instead of failing where the descriptors were leaked.
DESCRIPTOR_LIMIT = 512


def _descriptors() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


@pytest.fixture(autouse=True)
def _no_descriptor_leak() -> Iterator[None]:
    before = len(_descriptors())
    yield
    after = _descriptors()
    if len(after) > DESCRIPTOR_LIMIT and len(after) > before:
        kinds = Counter(Path(t).suffix or t.split(":")[0] for t in after).most_common(3)
        pytest.fail(f"this worker holds {len(after)} open descriptors ({before} before this "
                    f"test; the most: {kinds}): a leak", pytrace=False)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def start_broker(data_dir: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Start ``tierstream broker start`` processes; all are stopped at the end of the test."""
    started: list[BrokerProcess] = []

    def start(*args: str, data: Path | None = None, env: dict[str, str] | None = None,
              port: int = 0) -> BrokerProcess:
        proc = BrokerProcess(data or data_dir, args=list(args), env=env, port=port)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def free_port() -> int:
    """A loopback port for a broker restarted on the same address (``ports.py``)."""
    from .ports import fixed_port

    return fixed_port()


@pytest.fixture
def broker(start_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    """One broker with one bookie and default settings."""
    return start_broker()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on loopback for the whole session (no AWS account needed)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
              ) -> str:
    """A fresh bucket on the moto server, with credentials in the environment; its name."""
    import re
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    bucket = f"{name}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local SparkSession for the whole test session (Spark takes seconds to start)."""
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("tierstream-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .getOrCreate())
    yield session
    session.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this session (``tests/postgres.py``), started on first use."""
    yield from postgres_server()
