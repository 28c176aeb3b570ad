"""What the Spark adapter checks at load(), and the SparkSession the CLI starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierstream.read_options import ReadOptions
from tierstream.spark_adapter import register

from ..logs import TOPIC, fill, running_log
from ..timing import scaled

pytestmark = pytest.mark.spark


@pytest.mark.parametrize(("options", "needle"), [
    ({"topic": "acme/../b"}, "invalid topic name"),
    ({"topic": "acme/web/missing"}, "does not exist"),
    ({"topic": TOPIC, "startingTime": "2026-11-02", "endingTime": "2026-11-01"},
     "is before 'startingTime'"),
])
def test_bad_options_fail_at_load_not_when_the_query_runs(spark: Any, tmp_path: Path,
                                                          options: dict[str, str],
                                                          needle: str) -> None:
    with running_log(tmp_path / "data") as log:
        fill(log, partitions=1, batches=2, keys=3)
        register(spark)
        reader = spark.read.format("tierstream").option("dataDir", str(log.data_dir)) \
            .option("broker", log.url).options(**options)
        with pytest.raises(Exception, match=needle):
            reader.load()  # no action: nothing runs yet


def test_each_query_gets_its_own_subscription_by_default() -> None:
    a = ReadOptions.parse({"topic": TOPIC}).subscription
    b = ReadOptions.parse({"topic": TOPIC, "startingPosition": "latest"}).subscription
    assert a != b and a == ReadOptions.parse({"topic": TOPIC}).subscription
    assert ReadOptions.parse({"topic": TOPIC, "subscription": "mine"}).subscription == "mine"


def test_the_cli_starts_local_spark_on_loopback() -> None:
    script = ("from tierstream.spark_adapter.jobs import local_spark\n"
              "s = local_spark('t')\n"
              "print(s.conf.get('spark.driver.host'), s.conf.get('spark.driver.bindAddress'))\n"
              "s.stop()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(180),
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                               "TIERSTREAM_SPARK_MASTER": "local[1]"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["127.0.0.1", "127.0.0.1"]
    # the JVM itself was pinned before it looked for a routable address of its own
    assert "resolves to a loopback address" not in proc.stderr, proc.stderr[-2000:]


JOB = """
import sys
from pyspark.sql import SparkSession
from tierstream.spark_adapter import register

spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
register(spark)  # the session was made first, as in most jobs
print("rows", spark.read.format("tierstream").option("topic", sys.argv[1])
      .option("broker", sys.argv[2]).option("dataDir", sys.argv[3]).load().count())
print("workers ran", spark.sparkContext.pythonExec)
"""


def test_a_job_run_by_the_venvs_interpreter_unactivated_reads_on_spark(tmp_path: Path) -> None:
    # Regression: `.venv/bin/python job.py` (venv not activated, PYSPARK_PYTHON unset, as cron
    # and schedulers run jobs): register() set PYSPARK_PYTHON after the SparkContext was made,
    # the workers ran `python3` from PATH and failed: No module named 'tierstream'.
    import os
    import shutil

    elsewhere = tmp_path / "bin"  # PATH's python3: an interpreter without tierstream
    elsewhere.mkdir()
    (elsewhere / "python3").symlink_to(Path(sys.base_prefix) / "bin" / "python3")
    java = shutil.which("java")
    assert java is not None
    path = os.pathsep.join([str(elsewhere), str(Path(java).parent), "/usr/bin", "/bin"])
    probe = subprocess.run(["python3", "-c", "import tierstream"], capture_output=True,
                           env={"PATH": path}, timeout=scaled(60))
    assert probe.returncode != 0, "PATH's python3 must not have tierstream for this test"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    job = tmp_path / "job.py"
    job.write_text(JOB)
    with running_log(tmp_path / "data") as log:
        fill(log, partitions=2, batches=3, keys=5)
        expected = log.everything().num_rows
        proc = subprocess.run([sys.executable, str(job), TOPIC, log.url, str(log.data_dir)],
                              capture_output=True, text=True, cwd=tmp_path,
                              env={**env, "PATH": path}, timeout=scaled(240))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rows {expected}" in proc.stdout
    assert f"workers ran {sys.executable}" in proc.stdout
