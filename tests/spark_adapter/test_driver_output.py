"""The Spark driver's stderr passed on by tierstream (``spark_adapter/driver_output.py``):
everything reaches the terminal until a command stops Spark on purpose; after that, the
tracebacks PySpark's workers can print as their sockets close do not (a `tierstream tail`
stopped by Ctrl-C printed one about once in seven runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from tierstream.spark_adapter.driver_output import DriverOutput

from ..timing import scaled


def _read_all(fd: int, into: list[bytes]) -> threading.Thread:
    def run() -> None:
        with os.fdopen(fd, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                into.append(chunk)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_lines_pass_until_muted_and_a_muted_pipe_is_still_drained() -> None:
    jvm_read, jvm_write = os.pipe()
    term_read, term_write = os.pipe()
    seen: list[bytes] = []
    reader = _read_all(term_read, seen)
    relay = DriverOutput(jvm_read, term_write)
    os.write(jvm_write, b"WARN: one\nWARN: t")
    os.write(jvm_write, b"wo\n")
    relay.join(scaled(0.5))  # still open: the relay waits for more
    relay.mute()
    # far more than a pipe holds: a writer would block for good if the relay stopped reading
    writer = threading.Thread(target=lambda: [os.write(jvm_write, b"Traceback (most recent "
                                                       b"call last):\n" * 1000)
                                              for _ in range(20)], daemon=True)
    writer.start()
    writer.join(scaled(30))
    assert not writer.is_alive(), "the muted pipe was not drained"
    os.close(jvm_write)
    relay.join(scaled(30))
    os.close(term_write)
    reader.join(scaled(30))
    assert b"".join(seen) == b"WARN: one\nWARN: two\n"


#: what a driver JVM prints as it starts (Spark 4 on Java 17), whatever it runs
STARTUP = (b"WARNING: Using incubator modules: jdk.incubator.vector\n"
           b"Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties\n"
           b'Setting default log level to "WARN".\n'
           b"To adjust logging level use sc.setLogLevel(newLevel). For SparkR, use "
           b"setLogLevel(newLevel).\n"
           b"26/12/07 21:01:07 WARN NativeCodeLoader: Unable to load native-hadoop library for "
           b"your platform... using builtin-java classes where applicable\n")


@pytest.mark.parametrize("debug", [False, True])
def test_the_lines_every_driver_prints_as_it_starts_are_dropped_but_with_debug(
        debug: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if debug:
        monkeypatch.setenv("TIERSTREAM_DEBUG", "1")
    else:
        monkeypatch.delenv("TIERSTREAM_DEBUG", raising=False)
    jvm_read, jvm_write = os.pipe()
    term_read, term_write = os.pipe()
    seen: list[bytes] = []
    reader = _read_all(term_read, seen)
    relay = DriverOutput(jvm_read, term_write)
    said = b"26/12/07 21:01:09 WARN TaskSetManager: Lost task 0.0 in stage 1.0\n"
    os.write(jvm_write, STARTUP + said)
    os.close(jvm_write)
    relay.join(scaled(30))
    os.close(term_write)
    reader.join(scaled(30))
    assert b"".join(seen) == (STARTUP + said if debug else said)


@pytest.mark.spark
def test_a_local_session_passes_its_workers_stderr_on_and_drops_it_once_stopping() -> None:
    script = textwrap.dedent("""
        import sys
        from tierstream.spark_adapter.driver_output import mute_driver_output
        from tierstream.spark_adapter.jobs import local_spark

        def say(word):
            def write(row):
                print(word, file=sys.stderr, flush=True)
                return row
            return write

        spark = local_spark("driver-output-test")
        spark.sparkContext.parallelize([1], 1).map(say("worker-before-the-stop")).collect()
        mute_driver_output()
        spark.sparkContext.parallelize([1], 1).map(say("Traceback: worker-after-the-stop"))\
            .collect()
        spark.stop()
        print("done", flush=True)
    """)
    env = {**os.environ, "TIERSTREAM_SPARK_MASTER": "local[1]"}
    env.pop("TIERSTREAM_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=scaled(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "done"
    assert "worker-before-the-stop" in proc.stderr
    assert "worker-after-the-stop" not in proc.stderr
    # nor the lines every driver prints as it starts
    for mark in ("jdk.incubator.vector", "log4j2-defaults.properties", "default log level",
                 "sc.setLogLevel", "NativeCodeLoader"):
        assert mark not in proc.stderr, proc.stderr
