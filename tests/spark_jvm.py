"""Spark as the test suite starts it: every driver JVM of the suite's Spark (its shared session,
the jobs and CLI commands it runs as processes, the tiny benchmarks) is started by
``spark-submit``, which adds ``SPARK_SUBMIT_OPTS`` to its command line; :func:`configure` sets
it for this process and every process it starts.

A test's JVM lives seconds to minutes, so it starts with

- the JIT's first tier only and the serial collector: C2 compiling Spark's hot paths costs
  more than it wins in that time (a local session started in 6-7 s instead of 10-13 s, its
  first jobs ran in 8-9 s instead of 10-12 s, on 2 busy cores);
- a class-data archive of the classes a Spark driver loads, made once per machine, JDK and
  pyspark (about 25 s, 180 MB under the temporary directory): a session then starts in
  2.3-3.1 s instead of 4.5-5.6 s and runs its first jobs in 3.4 s instead of 5.4-6.2 s.
  Where the archive cannot be made, the JVMs start without it. (Not through a
  ``SPARK_CONF_DIR``: that directory goes on the class path, and an archive takes no
  directory with files in it.)

Not for production: long jobs want C2, and an archive must match the JDK and the jars.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .timing import scaled

#: JVM options for short runs; the JVM's own warnings go to stderr (stdout is what the CLI
#: tests read)
JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xlog:disable -Xlog:all=warning:stderr"

_ARCHIVE_RUN = """
import sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").appName("class-data archive")
         .config("spark.ui.enabled", "false").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.driver.host", "127.0.0.1").getOrCreate())
spark.range(0, 1000, numPartitions=2).selectExpr("id % 7 as k").groupBy("k").count().collect()
spark.range(0, 1000).write.parquet(sys.argv[1])
spark.read.parquet(sys.argv[1]).count()
spark.stop()
"""


def configure() -> None:
    """Set ``SPARK_SUBMIT_OPTS`` to the suite's JVM options, for this process and every process
    it starts (pytest-xdist's workers too); options already set there win."""
    if "SPARK_SUBMIT_OPTS" in os.environ:
        return
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr
    except OSError:
        return  # no Java: no Spark either, nothing to configure
    import pyspark

    key = hashlib.sha256(f"{java}|{pyspark.__version__}|{pyspark.__file__}".encode())
    root = Path(tempfile.gettempdir()) / f"tierstream-test-spark-{key.hexdigest()[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "spark.jsa"
    with (root / "lock").open("w") as lock:  # one maker at a time, on this machine
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not archive.exists():
            _make_archive(archive)
    shared = f" -XX:SharedArchiveFile={archive}" if archive.exists() else ""
    os.environ["SPARK_SUBMIT_OPTS"] = JAVA_OPTIONS + shared


def _make_archive(archive: Path) -> None:
    """Run a small Spark session that writes the classes it loaded at its exit; kept under
    ``archive`` only if the run succeeded (a half-written archive is never used)."""
    part = archive.with_suffix(".part")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_SUBMIT_OPTS": f"{JAVA_OPTIONS} -XX:ArchiveClassesAtExit={part}"}
        try:
            done = subprocess.run([sys.executable, "-c", _ARCHIVE_RUN, str(Path(tmp) / "p")],
                                  env=env, capture_output=True, timeout=scaled(300))
        except (OSError, subprocess.TimeoutExpired):
            done = None
    if done is not None and done.returncode == 0 and part.exists():
        part.replace(archive)
    else:
        with contextlib.suppress(OSError):
            part.unlink()
