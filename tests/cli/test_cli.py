"""The CLI as a user runs it: real processes, a real broker, real output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tierstream.broker.process import BrokerProcess

from .. import forkserver
from ..signals import tierstream_ignoring_sigint
from ..store.helpers import wait_for
from ..timing import scaled
from .terminal import in_terminal


def run(*args: str, stdin: str | None = None, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "tierstream", *args], input=stdin,
                          capture_output=True, text=True, timeout=scaled(120),
                          env={**os.environ, **(env or {})})


def test_a_session_through_the_cli(broker: BrokerProcess, data_dir: Path) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir)}
    assert run("topic", "create", "acme/web/clicks", "--partitions", "2",
               env=env).returncode == 0
    proc = run("produce", "acme/web/clicks", "--generate", "3000", "--keys", "20",
               "--start-time", "2026-11-01T00:00:00Z", "--step-ms", "1000", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = "\n".join(json.dumps({"key": f"k{i}", "value": f"hello {i}",
                                  "properties": {"src": "stdin"}}) for i in range(5))
    assert run("produce", "acme/web/clicks", stdin=lines, env=env).returncode == 0

    window = run("consume", "acme/web/clicks", "--from", "2026-11-01T00:10:00Z",
                 "--to", "1793492400000", env=env)  # 00:10 .. 00:20 (as epoch ms)
    rows = [json.loads(x) for x in window.stdout.splitlines()]
    assert len(rows) == 600
    assert all(1793491800000 <= r["publish_time"] < 1793492400000 for r in rows)
    assert set(rows[0]) >= {"topic", "key", "key_hash", "value", "publish_time", "partition",
                            "segment_id", "entry_id", "batch_index", "properties"}

    limited = run("consume", "acme/web/clicks", "--limit", "7", env=env)
    assert len(limited.stdout.splitlines()) == 7

    keyed = run("consume", "acme/web/clicks", "--key-range", "0:32768", env=env)
    hashes = [json.loads(x)["key_hash"] for x in keyed.stdout.splitlines()]
    assert hashes and all(0 <= h < 32768 for h in hashes)

    def segment_messages() -> int:
        segs = run("segments", "acme/web/clicks", "--json", env=env)
        return sum(r["messages"] for r in json.loads(segs.stdout))

    wait_for(lambda: segment_messages() == 3005, timeout=scaled(20),
             what="open segment stats to reach metadata.db")
    table = run("segments", "acme/web/clicks", env=env)
    assert "partition" in table.stdout and "lives in" in table.stdout

    listing = run("topic", "list", env=env)
    assert "acme/web/clicks" in listing.stdout


@pytest.mark.parametrize(("args", "stdin", "needle"), [
    (["topic", "create", "acme/../x"], None, "invalid topic name 'acme/../x'"),
    (["topic", "create", "a/b/c", "--partitions", "-2"], None, "invalid partition count -2"),
    (["consume", "a/b/c", "--from", "last tuesday"], None, "invalid --from 'last tuesday'"),
    (["consume", "a/b/c", "--key-range", "9:3"], None, "invalid key range [9, 3)"),
    (["consume", "a/b/c", "--from", "2026-11-02", "--to", "2026-11-01"], None,
     "is before --from"),
    (["produce", "a/b/c"], "{\"value\": 1}\n", "stdin line 1"),
    (["produce", "a/b/c"], "not json\n", "stdin line 1 is not JSON"),
    (["produce", "a/b/c", "--generate", "10", "--start-time", "soon"], None,
     "invalid --start-time 'soon'"),
    (["consume", "a/b/c", "--from", "1793664000"], None, "looks like epoch seconds"),
    (["read", "a/b/c", "--out", "x.parquet", "--from", '{"v": 1}'], None,
     "invalid --from"),
    (["bookie", "serve", "--dir", "/no/such/bookie"], None,
     "invalid bookie directory '/no/such/bookie'"),
    (["broker", "start", "--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"], None,
     "cannot read --tls-cert '/no/cert.pem'"),
    (["read", "a/b/c", "--out", "x.parquet", "--tls-ca", "/no/ca.pem"], None,
     "cannot read --tls-ca '/no/ca.pem'"),
    (["topic", "list", "--tls-ca", "/no/ca.pem"], None, "cannot read --tls-ca '/no/ca.pem'"),
    # a duration without a unit once meant milliseconds: --retention 30 deleted a week
    (["topic", "set", "a/b/c", "--retention", "30"], None,
     "invalid --retention '30': a duration needs a unit, e.g. 30d"),
    (["topic", "create", "a/b/c", "--retention", "7"], None, "a duration needs a unit"),
    (["offload", "a/b/c", "--older-than", "7"], None, "invalid --older-than '7'"),
])
def test_bad_input_is_one_clear_line_and_exit_status_2(args: list[str], stdin: str | None,
                                                       needle: str) -> None:
    proc = run(*args, stdin=stdin, env={"TIERSTREAM_BROKER": "grpc://127.0.0.1:1"})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_stdin_line_stops_produce_after_the_lines_before_it(broker: BrokerProcess
                                                                   ) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/c", env=env)
    proc = run("produce", "a/b/c", stdin='{"value": "ok"}\n{"value": 5}\n{"value": "no"}\n',
               env=env)
    assert proc.returncode == 2 and "stdin line 2" in proc.stderr
    assert "the 1 message(s) before it were sent to a/b/c, none after it" in proc.stderr
    assert [json.loads(x)["value"] for x in run("consume", "a/b/c", env=env).stdout
            .splitlines()] == ["ok"]


def test_produce_sends_stdin_lines_as_they_arrive(broker: BrokerProcess) -> None:
    # Regression: produce read all of stdin before sending anything.
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/live", env=env)
    proc = forkserver.popen([sys.executable, "-m", "tierstream", "produce", "a/b/live"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert proc.stdin is not None
        proc.stdin.write('{"value": "first"}\n')
        proc.stdin.flush()  # the pipe stays open: a live source

        def stored() -> list[str]:
            out = run("consume", "a/b/live", env=env).stdout
            return [json.loads(x)["value"] for x in out.splitlines()]

        wait_for(lambda: stored() == ["first"], timeout=scaled(30),
                 what="the first line to be sent while stdin is still open")
        proc.stdin.write('{"value": "second"}\n')
        proc.stdin.close()
        assert proc.wait(timeout=scaled(30)) == 0
    finally:
        proc.kill()
    assert stored() == ["first", "second"]


def test_ctrl_c_stops_a_following_consume_of_a_quiet_partition(broker: BrokerProcess) -> None:
    # Regression: with one partition, the following read waited inside the Flight stream's
    # read, which a signal does not interrupt: Ctrl-C did nothing until the next message.
    import signal
    import threading

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/quiet", env=env)
    run("produce", "a/b/quiet", stdin='{"value": "only"}\n', env=env)
    proc = subprocess.Popen(tierstream_ignoring_sigint("consume", "a/b/quiet", "--follow"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    try:
        wait_for(lambda: len(lines) == 1, timeout=scaled(30), what="the one message")
        proc.send_signal(signal.SIGINT)  # the partition is quiet from now on
        try:
            code = proc.wait(timeout=scaled(15))
        except subprocess.TimeoutExpired:
            pytest.fail("consume --follow did not stop on Ctrl-C")
    finally:
        proc.kill()
    assert code == 130 and "Traceback" not in (proc.stderr.read() if proc.stderr else "")


def test_unreachable_broker_exit_status_1() -> None:
    proc = run("topic", "list", env={"TIERSTREAM_BROKER": "grpc://127.0.0.1:1"})
    assert proc.returncode == 1
    assert "cannot reach the broker at grpc://127.0.0.1:1" in proc.stderr


def test_a_broker_address_where_another_grpc_service_answers_is_one_line() -> None:
    """Regression: a gRPC server that is not a tierstream broker (another service on the
    port) answered UNIMPLEMENTED, which came out as a traceback (ArrowNotImplementedError),
    in the CLI and in a consumer's threads."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    other = grpc.server(ThreadPoolExecutor(2))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        proc = run("topic", "list", env={"TIERSTREAM_BROKER": f"grpc://127.0.0.1:{port}"})
    finally:
        other.stop(0)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"the broker at grpc://127.0.0.1:{port} answered, but not as a tierstream " \
        "broker" in lines[0], lines[0]


def test_segments_on_a_missing_data_dir_names_it(tmp_path: Path) -> None:
    proc = run("segments", "a/b/c", "--data-dir", str(tmp_path / "nowhere"))
    assert proc.returncode == 1
    assert "nowhere" in proc.stderr


def test_plan_and_read_commands(broker: BrokerProcess, data_dir: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir)}
    run("topic", "create", "acme/web/clicks", "--partitions", "2", env=env)
    run("produce", "acme/web/clicks", "--generate", "2000", "--start-time",
        "2026-11-01T00:00:00Z", "--step-ms", "1000", env=env)
    table = run("plan", "acme/web/clicks", "--key-ranges", "4", env=env)
    assert table.returncode == 0, table.stderr
    assert "tail-consumer: 8 split(s)" in table.stdout
    lines = run("plan", "acme/web/clicks", "--json", env=env).stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["reader"] == "tail-consumer" for x in lines)
    out = tmp_path / "window.parquet"
    proc = run("read", "acme/web/clicks", "--from", "2026-11-01T00:10:00Z", "--to",
               "2026-11-01T00:20:00Z", "--key-ranges", "2", "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    written = pq.read_table(out)
    assert written.num_rows == 600 and written.schema.names[0] == "topic"
    # plan pins --to to the same cut as read (and backfill): the same splits, the same bounds
    planned = run("plan", "acme/web/clicks", "--from", "2026-11-01T00:10:00Z", "--to",
                  "2026-11-01T00:20:00Z", "--key-ranges", "2", "--json", env=env)
    cut_line = [x for x in planned.stderr.splitlines() if x.startswith("end cut: ")]
    assert cut_line and cut_line == [x for x in proc.stderr.splitlines()
                                     if x.startswith("end cut: ")]
    cut = json.loads(cut_line[0][len("end cut: "):])["positions"]
    for line in planned.stdout.splitlines():
        split = json.loads(line)
        assert split["end"] == cut[str(split["partition"])]
    bad = run("read", "acme/web/clicks", "--out", str(tmp_path / "x.csv"), env=env)
    assert bad.returncode == 2 and "must end in .parquet" in bad.stderr
    bad = run("plan", "acme/web/clicks", "--max-split-bytes", "lots", env=env)
    assert bad.returncode == 2 and "invalid --max-split-bytes 'lots'" in bad.stderr


@pytest.mark.spark
def test_backfill_runs_on_spark(broker: BrokerProcess, data_dir: Path, tmp_path: Path) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir),
           "TIERSTREAM_SPARK_MASTER": "local[2]"}
    run("topic", "create", "acme/web/clicks", "--partitions", "2", env=env)
    run("produce", "acme/web/clicks", "--generate", "3000", "--start-time",
        "2026-11-01T00:00:00Z", "--step-ms", "1000", env=env)
    out = tmp_path / "week"
    # one Spark run (a driver JVM is most of this test's time): a window, in key ranges,
    # into an Iceberg table; Parquet, the default, is what test_cluster.py and the tour write
    proc = run("backfill", "acme/web/clicks", "--from", "2026-11-01T00:10:00Z", "--to",
               "2026-11-01T00:30:00Z", "--key-ranges", "2", "--format", "iceberg",
               "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backfill of acme/web/clicks: 1,200 rows" in proc.stdout, proc.stdout
    assert "tail-consumer: 4" in proc.stdout, proc.stdout  # 2 partitions x 2 key ranges
    assert "Iceberg table backfill.acme_web_clicks" in proc.stdout, proc.stdout
    again = run("backfill", "acme/web/clicks", "--out", str(out), env=env)
    assert again.returncode == 2 and "exists" in again.stderr
    # refused before a Spark session started: no JVM, no Spark log line, just the error
    assert again.stderr.strip().count("\n") == 0, again.stderr
    bad = run("backfill", "acme/web/clicks", "--out", str(tmp_path / "x"), "--format", "csv",
              env=env)
    assert bad.returncode == 2 and "invalid --format 'csv'" in bad.stderr


@pytest.mark.slow
@pytest.mark.spark
def test_ctrl_c_during_a_tails_first_micro_batch_leaves_nothing_and_says_so(
        broker: BrokerProcess, data_dir: Path, tmp_path: Path) -> None:
    """Regression: Ctrl-C while the first micro-batch was writing printed Spark's "Aborting
    job" error and a Java trace, exited 0, and left that batch's part files in --out, where
    pyarrow or DuckDB would count them (Spark's log does not list them)."""
    import signal
    import threading

    import pyarrow.parquet as pq

    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir),
           "TIERSTREAM_SPARK_MASTER": "local[2]"}
    run("topic", "create", "acme/web/big", "--partitions", "2", env=env)
    produced = run("produce", "acme/web/big", "--generate", "400000", "--quiet", env=env)
    assert produced.returncode == 0, produced.stderr
    out, ckpt = tmp_path / "live", tmp_path / "ckpt"
    args = ["tail", "acme/web/big", "--from", "earliest", "--out", str(out),
            "--checkpoint", str(ckpt)]
    proc = subprocess.Popen(tierstream_ignoring_sigint(*args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True).start()
    try:  # Ctrl-C once the first batch writes its files, before Spark commits it
        wait_for(lambda: any(out.glob("part-*")) or proc.poll() is not None,
                 timeout=scaled(180), what="the first micro-batch's files")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=scaled(60))
    finally:
        proc.kill()
    said = "".join(stderr)
    assert code == 130, said[-3000:]
    assert "interrupted: stopped after the last committed micro-batch" in said, said[-3000:]
    assert not any(w in said for w in ("ERROR", "Exception", "Traceback", "\tat ")), said
    committed = out / "_spark_metadata" / "0"
    if not committed.exists():  # the stop came before the commit, as it should here
        assert not list(out.glob("part-*"))  # nothing a reader of the folder would count
    again = run(*args, "--available-now", env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    values = pq.read_table([str(f) for f in out.glob("part-*")]).column("value")
    assert len(values) == len(set(values.to_pylist())) == 400_000


@pytest.mark.spark
def test_tail_into_iceberg_commits_each_batch_once(broker: BrokerProcess, data_dir: Path,
                                                   tmp_path: Path) -> None:
    from pyiceberg.catalog.sql import SqlCatalog

    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir),
           "TIERSTREAM_SPARK_MASTER": "local[2]"}
    run("topic", "create", "acme/web/clicks", "--partitions", "2", env=env)
    run("produce", "acme/web/clicks", "--generate", "1000", env=env)
    out, ckpt = tmp_path / "live", tmp_path / "ckpt"
    args = ("tail", "acme/web/clicks", "--from", "earliest", "--available-now",
            "--max-records-per-trigger", "400", "--format", "iceberg", "--out", str(out),
            "--checkpoint", str(ckpt))
    proc = run(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 micro-batch(es)" in proc.stdout, proc.stdout  # --available-now: what is there
    catalog = SqlCatalog("default", uri=f"sqlite:///{out}/catalog.db")
    table = catalog.load_table("tail.acme_web_clicks")
    values = table.scan().to_arrow().column("value").to_pylist()
    assert len(values) == len(set(values)) == 1000
    assert len(table.snapshots()) == 3  # one commit per micro-batch
    # The driver dies after the table commit of batch 2, before Spark logs it as done:
    # Spark runs batch 2 again, and its files were written but never committed.
    (ckpt / "commits" / "2").unlink()
    (ckpt / "commits" / ".2.crc").unlink(missing_ok=True)
    orphan = next((out / "data").iterdir()).name.rsplit("-", 2)[0] + "-9-dead"
    (out / "data" / orphan).mkdir()
    proc = run(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = catalog.load_table("tail.acme_web_clicks")
    assert table.scan().to_arrow().num_rows == 1000  # batch 2 was not added twice
    assert len(table.snapshots()) == 3
    assert not (out / "data" / orphan).exists()  # uncommitted files are removed


def test_schemas_through_the_cli(broker: BrokerProcess, data_dir: Path,
                                 tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir)}
    topic = "acme/shop/orders"
    run("topic", "create", topic, "--partitions", "2", env=env)
    v1 = tmp_path / "v1.avsc"
    v1.write_text(json.dumps({"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "string"}, {"name": "amount", "type": "int"}]}))
    v2 = tmp_path / "v2.avsc"
    v2.write_text(json.dumps({"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "string"}, {"name": "amount", "type": "long"},
        {"name": "customer", "type": "string"}]}))
    proc = run("schema", "set", topic, "--type", "avro", "--file", str(v1), env=env)
    assert proc.returncode == 0 and "schema version 1" in proc.stdout, proc.stderr
    proc = run("schema", "check", topic, "--type", "avro", "--file", str(v2), env=env)
    assert proc.returncode == 1 and "field 'customer'" in proc.stdout
    proc = run("schema", "set", topic, "--type", "avro", "--file", str(v2), env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr  # one line
    assert "incompatible schema" in proc.stderr and "BACKWARD" in proc.stderr
    proc = run("schema", "set", topic, "--type", "avro", "--file", str(tmp_path / "nope"),
               env=env)
    assert proc.returncode == 2 and "cannot read --file" in proc.stderr
    assert "BACKWARD" in run("schema", "list", topic, env=env).stdout
    assert '"amount"' in run("schema", "get", topic, env=env).stdout
    from tierstream.client import Producer

    with Producer(topic, broker=broker.url) as producer:  # the topic's schema, looked up
        producer.send_many({"key": f"k{i}", "value": {"id": f"o{i}", "amount": i}}
                           for i in range(20))
    proc = run("consume", topic, "--value-format", "auto", "--limit", "3", env=env)
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(rows) == 3 and set(rows[0]["value"]) == {"id", "amount"}, proc.stderr
    out = tmp_path / "orders.parquet"
    proc = run("read", topic, "--value-format", "auto", "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    table = pq.read_table(out)
    assert table.num_rows == 20 and table.schema.field("value").type.num_fields == 2
    lines = "\n".join(json.dumps({"key": "k", "value": v}) for v in
                      ({"id": "o20", "amount": 20}, {"id": "o21", "amount": "many"}))
    proc = run("produce", topic, stdin=lines, env=env)
    assert proc.returncode == 2 and "field 'amount'" in proc.stderr, proc.stderr
    assert "the 1 message(s) before it were sent" not in proc.stderr  # one batch: none sent
    run("topic", "create", "acme/web/plain", env=env)
    proc = run("produce", "acme/web/plain", stdin='{"value": {"a": 1}}', env=env)
    assert proc.returncode == 2 and "needs a topic schema" in proc.stderr, proc.stderr
    assert sum(1 for _ in run("consume", topic, env=env).stdout.splitlines()) == 20
    proc = run("consume", topic, "--value-format", "fancy", env=env)
    assert proc.returncode == 2 and "invalid option 'valueFormat' 'fancy'" in proc.stderr


def test_transactions_are_listed_and_a_stuck_one_aborted(broker: BrokerProcess) -> None:
    from tierstream.client import Admin, Transaction

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/out", 2)
    stuck = Transaction(broker=broker.url, sink="etl", batch=4)
    stuck.write("acme/web/out", pa.table({"value": [b"x"] * 10}))
    stuck.prepare()
    proc = run("transactions", env=env)
    assert proc.returncode == 0 and stuck.txn_id in proc.stdout and "PREPARED" in proc.stdout
    proc = run("transactions", "--abort", stuck.txn_id, env=env)
    assert proc.returncode == 0 and "aborted" in proc.stdout
    rows = json.loads(run("transactions", "--json", env=env).stdout)
    assert [(r["txn_id"], r["state"]) for r in rows] == [(stuck.txn_id, "ABORTED")]
    proc = run("transactions", "--abort", "../x", env=env)
    assert proc.returncode == 2 and "invalid transaction id" in proc.stderr
    # an id the broker never had is not "had already ended" (exit 0)
    proc = run("transactions", "--abort", "nosuch", env=env)
    assert proc.returncode == 2 and "knows no transaction 'nosuch'" in proc.stderr


USAGE_ERRORS = [
    ([], "Usage"),  # a bare group shows its help
    (["topic"], "Usage"),
    (["bogus"], "No such command 'bogus'"),
    (["topic", "create"], "Missing argument 'topic'"),
    (["topic", "create", "a/b/c", "--partitions", "abc"], "(got 'abc')"),
    (["topic", "create", "a/b/c", "--partitons", "3"], "did you mean --partitions?"),
    (["consume"], "Missing argument 'topic'"),
    (["broker", "start", "--port", "99999"], "invalid port 99999"),
]


@pytest.mark.parametrize(("args", "needle"), USAGE_ERRORS, ids=lambda a: " ".join(a)
                         if isinstance(a, list) else None)
def test_usage_errors_are_one_line_and_exit_status_2(args: list[str], needle: str,
                                                     tmp_path: Path) -> None:
    proc = run(*args, env={"TIERSTREAM_HOME": str(tmp_path / "d")})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    if needle != "Usage":
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_version_prints_the_version() -> None:
    import tierstream

    proc = run("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"tierstream {tierstream.__version__}")


def test_environment_errors_are_one_line_and_exit_status_1(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = run("broker", "start", "--data-dir", str(a_file), "--port", "0")
    assert proc.returncode == 1 and "exists but is not a directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    proc = run("segments", "a/b/c", "--data-dir", str(a_file))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_a_read_only_data_dir_is_one_line_and_exit_status_1(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr.strip()}")
    try:
        for data_dir, needle in ((ro, "is not writable"), (ro / "d", "cannot create")):
            proc = run("broker", "start", "--data-dir", str(data_dir), "--port", "0")
            assert proc.returncode == 1 and needle in proc.stderr, proc.stderr
            assert "Read-only file system" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_an_ipv6_loopback_broker_starts(tmp_path: Path) -> None:
    try:
        proc = BrokerProcess(tmp_path / "d", host="::1").start()
    except Exception as exc:  # no IPv6 on this host
        if "Cannot assign requested address" in str(exc) or "Address family" in str(exc):
            pytest.skip(f"no IPv6 loopback here: {exc}")
        raise
    try:
        assert proc.url is not None and proc.url.startswith("grpc://[::1]:")
        topics = run("topic", "list", "--broker", proc.url)
        assert topics.returncode == 0, topics.stderr
    finally:
        proc.stop()


def test_debug_shows_the_traceback() -> None:
    proc = run("--debug", "topic", "list", env={"TIERSTREAM_BROKER": "grpc://127.0.0.1:1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr


@pytest.mark.spark
def test_tail_rides_out_a_broker_restart_and_reports_its_lag(start_broker, free_port,
                                                             data_dir: Path,
                                                             tmp_path: Path) -> None:
    import re
    import signal
    import threading

    from tierstream.spark_adapter.jobs import checkpoint_subscription

    broker = start_broker(port=free_port)
    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(data_dir),
           "TIERSTREAM_SPARK_MASTER": "local[2]"}
    run("topic", "create", "acme/web/clicks", "--partitions", "2", env=env)
    run("produce", "acme/web/clicks", "--generate", "500", env=env)
    ckpt = tmp_path / "ckpt"
    proc = forkserver.popen([sys.executable, "-m", "tierstream", "tail", "acme/web/clicks",
                             "--from", "earliest", "--out", str(tmp_path / "live"),
                             "--checkpoint", str(ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True).start()

    def rows() -> int:
        return sum(int(m.group(1).replace(",", "")) for line in list(lines)
                   if (m := re.search(r"micro-batch \d+: ([\d,]+) rows", line)))

    try:
        wait_for(lambda: rows() == 500, timeout=scaled(180), what="the first 500 rows")
        broker.stop()  # restart the broker under the running query
        restarted = start_broker(port=free_port)
        assert run("produce", "acme/web/clicks", "--generate", "300",
                   env={**env, "TIERSTREAM_BROKER": restarted.url or ""}).returncode == 0
        wait_for(lambda: rows() == 800, timeout=scaled(180),
                 what="the rows produced after the restart")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=scaled(120))
    finally:
        proc.kill()
    assert code == 130, "".join(lines)[-3000:]  # stopped by Ctrl-C, after its last commit
    assert any("behind: 0 message(s)" in line for line in lines), "".join(lines)[-2000:]
    assert "Traceback" not in "".join(lines)
    subs = run("subscriptions", "acme/web/clicks", "--json", env=env)
    names = {r["subscription"] for r in json.loads(subs.stdout)}
    assert names == {checkpoint_subscription(str(ckpt))}
    # the table says whose cursor it is and how to remove it once the query is gone
    shown = run("subscriptions", "acme/web/clicks", env=env).stdout
    name = checkpoint_subscription(str(ckpt))
    assert f"{name}: the cursor of tierstream tail --checkpoint {ckpt}" in shown, shown
    assert f"--delete {name}" in shown, shown


def test_offload_says_why_each_segment_stayed(broker: BrokerProcess) -> None:
    import time

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/old", env=env)
    now = int(time.time() * 1000)
    old = "\n".join(json.dumps({"value": f"o{i}", "publish_time": now - 10 * 86_400_000})
                    for i in range(3))
    assert run("produce", "a/b/old", stdin=old, env=env).returncode == 0
    run("seal", "a/b/old", env=env)  # segment 1: ten days old
    assert run("produce", "a/b/old", stdin='{"value": "new"}\n', env=env).returncode == 0
    run("seal", "a/b/old", env=env)  # segment 2: newer (its time never goes back)
    assert run("produce", "a/b/old", stdin='{"value": "newest"}\n', env=env).returncode == 0
    proc = run("offload", "a/b/old", "--older-than", "7d", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "offloaded 1 closed segment(s) whose newest message is older than 7 days" \
        in proc.stdout
    assert "kept 2 segment(s) where they are" in proc.stdout
    assert "younger than --older-than 7d" in proc.stdout
    assert "open: still being written" in proc.stdout


def test_retention_is_echoed_in_words_and_shown_and_names_exit_2(broker: BrokerProcess
                                                                  ) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    created = run("topic", "create", "acme/web/kept", "--retention", "36h", env=env)
    assert created.returncode == 0, created.stderr
    assert "retention: 1 day 12 hours (closed segments whose newest message is older" \
        in created.stdout
    changed = run("topic", "set", "acme/web/kept", "--retention", "30d", env=env)
    assert "acme/web/kept: retention: 30 days" in changed.stdout
    listed = run("topic", "list", env=env).stdout
    assert "30 days" in listed and "retention" in listed
    shown = run("topic", "get", "acme/web/kept", env=env)
    assert shown.returncode == 0 and "partitions: 1" in shown.stdout
    assert "retention:  30 days" in shown.stdout and "schema:     none" in shown.stdout
    # naming a topic that is not there (or already is) is bad input: exit 2
    missing = run("topic", "get", "acme/web/nope", env=env)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    again = run("topic", "create", "acme/web/kept", env=env)
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_port_in_use_is_an_environment_problem_exit_1(broker: BrokerProcess,
                                                        tmp_path: Path) -> None:
    port = (broker.url or "").rsplit(":", 1)[1]
    proc = run("broker", "start", "--data-dir", str(tmp_path / "other"), "--port", port)
    assert proc.returncode == 1 and f"in use on this host: {port} (--port" in proc.stderr, \
        proc.stderr
    assert proc.stderr.count("\n") == 1


def test_help_lists_commands_sorted_with_whole_sentences_and_no_flag_placeholders() -> None:
    root = run("--help", env={"COLUMNS": "200"}).stdout
    assert "--debug" in root
    plain = ["backfill", "consume", "demo", "offload", "plan", "produce", "read", "seal",
             "segments", "subscriptions", "tail", "transactions"]
    where = [root.index(f"│ {c} ") for c in plain]
    assert where == sorted(where), "commands are listed in alphabetical order"
    assert "Run the backfill on Spark: a bounded read of the topic, written as Parquet files " \
        "or as an Iceberg table." in root
    for command in (["topic", "delete"], ["broker", "start"], ["produce"]):
        text = run(*command, "--help", env={"COLUMNS": "200"}).stdout
        assert "<bool>" not in text, command
        assert "(default 1) [default: 1]" not in text


def test_producing_history_behind_newer_messages_warns_how_many_were_restamped(
        broker: BrokerProcess, data_dir: Path, tmp_path: Path) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "acme/web/late", env=env)
    now = run("produce", "acme/web/late", stdin='{"value": "today"}\n', env=env)
    assert now.returncode == 0 and "warning" not in now.stderr
    history = run("produce", "acme/web/late", "--generate", "50", "--start-time",
                  "2026-11-01T00:00:00Z", "--step-ms", "1000", env=env)
    assert history.returncode == 0, history.stderr
    assert "50 of 50 message(s) asked for a publish time before the newest message" \
        in " ".join(history.stderr.split())
    stdin = run("produce", "acme/web/late", env=env,
                stdin='{"value": "old", "publish_time": "2026-11-02T00:00:00Z"}\n')
    assert "1 of 1 message(s)" in " ".join(stdin.stderr.split())
    # the week is not there by publish time, and is by event time, where a user asks for it
    window = ["--from", "2026-11-01T00:00:10Z", "--to", "2026-11-01T00:00:20Z"]
    assert run("consume", "acme/web/late", *window, env=env).stdout == ""
    by_event = run("consume", "acme/web/late", *window, "--time-field", "event_time", env=env)
    assert by_event.returncode == 0, by_event.stderr
    assert len(by_event.stdout.splitlines()) == 10
    out = tmp_path / "week.parquet"
    read = run("read", "acme/web/late", *window, "--time-field", "event-time", "--out",
               str(out), "--data-dir", str(data_dir), env=env)
    assert read.returncode == 0, read.stderr
    import pyarrow.parquet as pq

    assert pq.read_table(out).num_rows == 10
    import tierstream

    table = tierstream.read("acme/web/late", start="2026-11-01T00:00:10Z",
                            end="2026-11-01T00:00:20Z", time_field="event_time",
                            broker=broker.url, data_dir=str(data_dir))
    assert table.num_rows == 10
    bad = run("consume", "acme/web/late", "--from", "0:1:0", "--time-field", "event_time",
              env=env)
    assert bad.returncode == 2 and "takes times, earliest or latest" in bad.stderr


def test_the_readme_schema_example_runs_with_the_shipped_files(broker: BrokerProcess) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    assert run("topic", "create", "acme/shop/orders", "--partitions", "2",
               env=env).returncode == 0
    one = run("schema", "set", "acme/shop/orders", "--type", "avro", "--file",
              str(examples / "order.avsc"), env=env)
    assert one.returncode == 0, one.stderr
    check = run("schema", "check", "acme/shop/orders", "--type", "avro", "--file",
                str(examples / "order-v2.avsc"), env=env)
    assert "field 'customer' is not in the writer's schema" in check.stdout
    two = run("schema", "set", "acme/shop/orders", "--type", "avro", "--file",
              str(examples / "order-v2.avsc"), "--compatibility", "FORWARD", env=env)
    assert two.returncode == 0 and "version 2" in two.stdout, two.stdout + two.stderr
    # schema get writes a file schema set takes back (the version line goes to stderr)
    got = run("schema", "get", "acme/shop/orders", "--version", "1", env=env)
    assert json.loads(got.stdout) == json.loads((examples / "order.avsc").read_text())
    assert "version 1" in got.stderr
    # Avro binary is often valid UTF-8 made of control characters: consume prints it as
    # value_b64 unless asked to decode it
    sent = run("produce", "acme/shop/orders", env=env, stdin=json.dumps(
        {"key": "o1", "value": {"id": "o1", "amount": 3, "currency": "EUR",
                                "customer": "c"}}) + "\n")
    assert sent.returncode == 0, sent.stderr
    row = json.loads(run("consume", "acme/shop/orders", env=env).stdout)
    assert "value" not in row and row["value_b64"]
    decoded = json.loads(run("consume", "acme/shop/orders", "--value-format", "auto",
                             env=env).stdout)
    assert decoded["value"]["customer"] == "c"


def test_consume_of_a_window_retention_cut_into_fails_or_says_what_it_skipped(
        broker: BrokerProcess) -> None:
    # Regression: consume printed what survived of such a window, exit 0 and not a word,
    # while read over the same window failed with DataLossError.
    import time

    from tierstream.client import Admin

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/kept", "--partitions", "2", env=env)
    now = int(time.time() * 1000)
    old = "\n".join(json.dumps({"key": f"k{i}", "value": f"old{i}",
                                "publish_time": now - 10 * 86_400_000}) for i in range(20))
    assert run("produce", "a/b/kept", stdin=old, env=env).returncode == 0
    run("seal", "a/b/kept", env=env)
    new = "\n".join(json.dumps({"key": f"k{i}", "value": f"new{i}"}) for i in range(20))
    assert run("produce", "a/b/kept", stdin=new, env=env).returncode == 0
    assert run("topic", "set", "a/b/kept", "--retention", "7d", env=env).returncode == 0
    with Admin(broker.url) as admin:
        admin.tier_pass()
        assert {d["partition"] for d in admin.deleted_segments("a/b/kept")} == {0, 1}
    window = ("--from", f"{now - 11 * 86_400_000}", "--to", f"{now + 3_600_000}")
    failed = run("consume", "a/b/kept", *window, env=env)
    assert failed.returncode == 1 and failed.stdout == ""
    assert "data loss in 'a/b/kept' partition 0" in failed.stderr
    assert "--skip-data-loss" in failed.stderr and "Traceback" not in failed.stderr
    skipped = run("consume", "a/b/kept", *window, "--skip-data-loss", env=env)
    assert skipped.returncode == 0, skipped.stderr
    values = sorted(json.loads(line)["value"] for line in skipped.stdout.splitlines())
    assert values == sorted(f"new{i}" for i in range(20))
    assert "partition 0" in skipped.stderr and "partition 1" in skipped.stderr
    assert "skipping them" in skipped.stderr
    # from earliest, nothing is lost: what is there is the window
    assert run("consume", "a/b/kept", env=env).stdout.count("\n") == 20
    # a position names its partition: that partition is read (it said "not in partition 0")
    rows = [json.loads(line) for line in skipped.stdout.splitlines()]
    first = min((r["segment_id"], r["entry_id"]) for r in rows if r["partition"] == 1)
    from_position = run("consume", "a/b/kept", "--from", f"1:{first[0]}:{first[1]}", env=env)
    assert from_position.returncode == 0, from_position.stderr
    assert {json.loads(line)["partition"] for line in from_position.stdout.splitlines()} == {1}
    assert run("consume", "a/b/kept", "--from", "latest", "--to", "earliest",
               env=env).stderr.count("is before --from") == 1


def test_a_named_produce_replayed_stores_nothing_twice(broker: BrokerProcess) -> None:
    # Regression: `produce --name imp < three.jsonl` twice stored 6 messages.
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/dedup", "--partitions", "2", env=env)
    three = "".join(json.dumps({"value": f"m{i}", **({"key": f"k{i}"} if i % 2 else {})})
                    + "\n" for i in range(3))
    first = run("produce", "a/b/dedup", "--name", "imp", stdin=three, env=env)
    assert first.returncode == 0, first.stderr
    again = run("produce", "a/b/dedup", "--name", "imp", stdin=three, env=env)
    assert again.returncode == 0, again.stderr
    assert "produced 0 message(s)" in again.stderr and "skipped 3 message(s)" in again.stderr
    # a longer replay (an input that grew, or one cut short by a crash) adds only what is new
    five = three + "".join(json.dumps({"value": f"m{i}"}) + "\n" for i in range(3, 5))
    grown = run("produce", "a/b/dedup", "--name", "imp", stdin=five, env=env)
    assert "produced 2 message(s)" in grown.stderr, grown.stderr
    # explicit ids, as a source that numbers its records would give them
    numbered = "".join(json.dumps({"value": f"n{i}", "sequence_id": 100 + 10 * i}) + "\n"
                       for i in range(2))
    for _ in range(2):
        assert run("produce", "a/b/dedup", "--name", "ids", stdin=numbered,
                   env=env).returncode == 0
    values = sorted(json.loads(line)["value"]
                    for line in run("consume", "a/b/dedup", env=env).stdout.splitlines())
    assert values == ["m0", "m1", "m2", "m3", "m4", "n0", "n1"]
    # an id that goes back, or one without --name, is one line naming the value
    bad = run("produce", "a/b/dedup", "--name", "ids",
              stdin=numbered + json.dumps({"value": "x", "sequence_id": 5}) + "\n", env=env)
    assert bad.returncode == 2, bad.stderr
    assert "stdin line 3: sequence_id 5 does not increase" in bad.stderr, bad.stderr
    unnamed = run("produce", "a/b/dedup", stdin=numbered, env=env)
    assert unnamed.returncode == 2 and "give --name" in unnamed.stderr


def test_ctrl_c_on_a_long_produce_says_how_many_were_stored(broker: BrokerProcess) -> None:
    """Regression: ``produce --generate`` stopped by Ctrl-C exited 130 without a word, though
    hundreds of thousands of messages had been stored."""
    import re
    import signal

    from tierstream.client import Admin

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "a/b/long", "--partitions", "2", env=env)

    def stored() -> int:
        with Admin(broker.url) as admin:
            storage = admin.topic_stats("a/b/long")["storage"]
        return sum(int(s["messages"]) for s in storage.values())

    proc = subprocess.Popen(tierstream_ignoring_sigint("produce", "a/b/long", "--generate",
                                                       "5000000", "--batch-size", "500"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    try:
        wait_for(lambda: stored() >= 10_000, timeout=scaled(60), what="some messages stored")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=scaled(30))
    finally:
        proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 130, stderr
    said = re.search(r"interrupted: ([\d,]+) message\(s\) were stored in a/b/long"
                     r"(?:, and up to ([\d,]+) more)?", stderr)
    assert said, stderr
    low = int(said.group(1).replace(",", ""))
    high = low + int((said.group(2) or "0").replace(",", ""))
    assert 0 < low <= stored() <= high
    assert "Traceback" not in stderr


def test_tables_fit_an_80_column_terminal(broker: BrokerProcess) -> None:
    """Regression: at 80 columns, subscriptions and segments cut every column to a few
    characters and an ellipsis. Now the least important columns are left out (and named)."""
    from tierstream.client import Consumer
    from tierstream.model.positions import Offset

    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "acme/web/narrow", "--partitions", "2", env=env)
    run("produce", "acme/web/narrow", "--generate", "300", env=env)
    Consumer("acme/web/narrow", "billing", mode="key_shared", initial=Offset.earliest(),
             broker=broker.url).close()
    for command in (["subscriptions", "acme/web/narrow"], ["segments", "acme/web/narrow"]):
        code, text = in_terminal([sys.executable, "-m", "tierstream", *command], env)
        assert code == 0, text
        table = [ln for ln in text.splitlines() if ln[:1] in "┏┃┡│└"]
        assert table and all(len(ln) <= 80 for ln in table), text
        assert "…" not in text and "hidden at this width:" in text, text
        assert "billing" in text if command[0] == "subscriptions" else "OPEN" in text


def test_help_shows_the_defaults_its_text_names() -> None:
    """Regression: a default written in a help text as ``[default: ...]`` was taken for
    rich markup and vanished, leaving ``(0: off) .``; and --broker said only "Broker URL"."""
    shown = run("broker", "start", "--help", env={"COLUMNS": "200"}).stdout
    flat = " ".join(shown.replace("│", " ").split())  # the help column wraps where it may
    assert "[default: 8080" in flat and "[default: 6652]" in flat, shown
    assert not re.search(r"\S \.(\s|$)", shown), shown  # a sentence's end left alone
    listed = run("consume", "--help", env={"COLUMNS": "200"}).stdout
    assert "comma-separated" in listed, listed


def test_broker_start_detach_returns_once_serving_and_broker_stop_stops_it(tmp_path: Path
                                                                           ) -> None:
    """``broker start --detach`` returns when the broker serves (or with its error and a
    non-zero exit, nothing left running), and ``broker stop`` stops it cleanly: the tour's
    way to run a broker in the background, so a failure cannot scroll by while the next
    commands talk to whatever else listens on the port."""
    data = tmp_path / "store"
    ports = ["--port", "0", "--pulsar-port", "0", "--admin-port", "0"]
    started = run("broker", "start", "--data-dir", str(data), *ports, "--detach")
    try:
        assert started.returncode == 0, started.stderr
        assert "listening on grpc://127.0.0.1:" in started.stdout, started.stdout
        url = re.search(r"listening on (\S+)", started.stdout).group(1)  # type: ignore[union-attr]
        assert run("topic", "create", "acme/detach/t", "--broker", url).returncode == 0
        # a second one on the same directory: its error, and a non-zero exit
        again = run("broker", "start", "--data-dir", str(data), *ports, "--detach")
        assert again.returncode == 1 and "already in use" in again.stderr, again.stderr
    finally:
        stopped = run("broker", "stop", "--data-dir", str(data))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert "broker shutting down" in (tmp_path / "store.log").read_text()
    none = run("broker", "stop", "--data-dir", str(data))
    assert none.returncode == 2 and "no broker serves" in none.stderr, none.stderr


def test_a_standby_started_with_detach_returns_once_it_stands_by_and_stops(
        tmp_path: Path, start_broker: Any, postgres: Any) -> None:
    """Regression: ``broker start --standby --detach`` never returned (it waited for a
    "listening" line that a standby prints only when it takes over), and ``broker stop``
    said no broker serves its directory (a standby took its directory's lock only after the
    takeover, so a second broker could start on it too)."""
    url = postgres.new_database()
    start_broker("--metadata", url)  # the serving broker
    data = tmp_path / "standby"
    args = ["broker", "start", "--data-dir", str(data), "--port", "0", "--pulsar-port", "0",
            "--admin-port", "0", "--metadata", url, "--standby", "--takeover-after", "60s",
            "--tier-url", str(tmp_path / "tier"), "--tier-shared",
            "--catalog-uri", f"sqlite:///{tmp_path / 'catalog.db'}", "--detach"]
    started = run(*args)
    try:
        assert started.returncode == 0, started.stderr
        assert "standby running in the background" in started.stdout, started.stdout
        again = run(*args)  # its directory is held while it stands by
        assert again.returncode == 1 and "already in use" in again.stderr, again.stderr
    finally:
        stopped = run("broker", "stop", "--data-dir", str(data))
    assert stopped.returncode == 0 and "stopped the broker of" in stopped.stdout, \
        stopped.stderr
