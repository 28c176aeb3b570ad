"""Mistakes found before any work (issue 79 §2-§3): one line naming the value, exit 2,
nothing created or half-written, and no "unexpected" error."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess

from .test_cli import run

NO_BROKER = {"TIERSTREAM_BROKER": "grpc://127.0.0.1:1"}


@pytest.mark.parametrize(("args", "stdin", "needle"), [
    (["produce", "a/b/c"], '{"value": "a", "value_b64": "YQ=="}\n',
     "stdin line 1: give value or value_b64, not both"),
    (["produce", "a/b/c"], '{"value": "\\ud800"}\n', "stdin line 1 has a lone surrogate"),
    (["produce", "a/b/c"], '\n\udcff\udcfe\n', "stdin line 2 is not UTF-8"),
    (["read", "a/b/c", "--out", "/etc/hostname/x.parquet"], None,
     "--out '/etc/hostname/x.parquet': '/etc/hostname' is a file, not a directory"),
    (["read", "a/b/c", "--out", "/proc/x.parquet"], None,
     "--out '/proc/x.parquet': cannot write in '/proc'"),
    (["read", "a/b/c", "--out", "x.parquet", "--cut-out", "no/such/dir/c.cut"], None,
     "--cut-out 'no/such/dir/c.cut': directory 'no/such/dir' does not exist"),
    (["backfill", "a/b/c", "--out", "bf", "--cut-out", "no/such/dir/c.cut"], None,
     "--cut-out 'no/such/dir/c.cut': directory 'no/such/dir' does not exist"),
    (["tail", "a/b/c", "--out", "live", "--checkpoint", "ck", "--format", "orc"], None,
     "invalid --format 'orc'"),
    (["tail", "a/b/c", "--out", "/etc/hostname/live", "--checkpoint", "ck"], None,
     "--out '/etc/hostname/live': '/etc/hostname' is a file"),
    (["broker", "stop", "--data-dir", "/etc/hostname"], None,
     "--data-dir '/etc/hostname' is a file, not a data directory"),
    (["topic", "create", "a/b/c", "--retention", "99999999999999999999d"], None,
     "invalid --retention '99999999999999999999d': longer than any store keeps data"),
    (["topic", "create", "a/b/c-partition-3"], None,
     "a name ending in -partition-3 is how Pulsar names partition 3 of topic 'a/b/c'"),
])
def test_a_mistake_is_one_line_before_any_work(args: list[str], stdin: str | None,
                                               needle: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tierstream", *args], input=stdin,
                          capture_output=True, text=True, cwd=tmp_path, errors="surrogateescape",
                          env={**NO_BROKER, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert needle in " ".join(proc.stderr.split()), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "unexpected" not in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize(("option", "needle"), [
    (["--tier-url", "ftp://x/y"], "invalid tier URL 'ftp://x/y'"),
    (["--tier-url", "/etc/hostname"], "invalid --tier-url '/etc/hostname': '/etc/hostname' "
     "is a file"),
    (["--catalog-uri", "bogus"], "invalid --catalog-uri 'bogus': expected a SQLAlchemy URI"),
    (["--catalog-uri", "sqlite:////no/such/dir/c.db"], "directory '/no/such/dir' does not"),
    (["--transaction-timeout", "0"], "invalid option 'transactionTimeout'"),
    (["--max-publish-time-ahead", "soon"], "invalid option 'maxPublishTimeAhead'"),
    (["--max-publish-time-ahead", "-1h"], "invalid option 'maxPublishTimeAhead'"),
    (["--max-publish-time-ahead", "5"], "a duration needs a unit"),
])
def test_a_broker_option_it_cannot_use_is_refused_before_the_data_dir_is_made(
        option: list[str], needle: str, tmp_path: Path) -> None:
    """Before: the data directory, its metadata, bookies and lock were made, then the broker
    failed (a tier URL), or it served and failed at the first offload or transaction."""
    data = tmp_path / "data"
    proc = run("broker", "start", "--data-dir", str(data), "--port", "0", "--pulsar-port", "0",
               "--admin-port", "0", *option)
    assert proc.returncode == 2, proc.stderr
    assert needle in " ".join(proc.stderr.split()), proc.stderr
    assert not data.exists()


def test_debug_keeps_the_exit_status_of_bad_input() -> None:
    """Before: --debug turned exit 2 (bad input) into 1."""
    proc = run("--debug", "topic", "create", "a/b", env=NO_BROKER)
    assert proc.returncode == 2 and "Traceback" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: invalid topic name")


def test_broker_stop_does_not_signal_a_pid_that_does_not_hold_the_lock(tmp_path: Path) -> None:
    """Before: it signalled whatever process had the pid the lock file records."""
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            lock.write(f"{sleeper.pid}\n")
            lock.flush()
            proc = run("broker", "stop", "--data-dir", str(data))
            assert proc.returncode == 2, proc.stderr
            assert f"the pid it records ({sleeper.pid}) does not hold it" in proc.stderr
            assert sleeper.poll() is None  # not signalled
        finally:
            sleeper.kill()
            sleeper.wait()


def test_tail_of_a_topic_that_does_not_exist_fails_before_spark(broker: BrokerProcess,
                                                                 tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = run("tail", "acme/web/nope", "--out", str(work / "live"), "--checkpoint",
               str(work / "ck"), env={"TIERSTREAM_BROKER": broker.url or ""})
    assert proc.returncode == 2 and "'acme/web/nope' does not exist" in proc.stderr, \
        proc.stderr
    assert "Spark" not in proc.stderr and list(work.iterdir()) == []


def test_everyday_reads_and_settings_say_what_they_do(broker: BrokerProcess,
                                                       tmp_path: Path) -> None:
    """Issue 79 §5: a cut in consume's --from/--to, a position in no segment of its
    partition, a reader that leaves the pipe, a broker URL without a port, text for an Avro
    topic, and a retention that deletes at once."""
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "acme/web/c", "--partitions", "2", env=env)
    run("produce", "acme/web/c", "--generate", "10", env=env)
    cut = tmp_path / "c.cut"
    done = run("read", "acme/web/c", "--out", str(tmp_path / "x.parquet"), "--cut-out", str(cut),
               "--data-dir", str(broker.data_dir), env=env)
    assert done.returncode == 0, done.stderr
    run("produce", "acme/web/c", "--generate", "5", env=env)
    after = run("consume", "acme/web/c", "--from", f"@{cut}", env=env)
    assert after.returncode == 0 and len(after.stdout.splitlines()) == 5, after.stderr
    before = run("consume", "acme/web/c", "--to", f"@{cut}", env=env)
    assert before.returncode == 0 and len(before.stdout.splitlines()) == 10, before.stderr
    missing = run("consume", "acme/web/c", "--from", f"@{tmp_path / 'nope.cut'}", env=env)
    assert missing.returncode == 2 and "cannot read the cut file" in missing.stderr
    nowhere = run("consume", "acme/web/c", "--from", "0:999:0", env=env)
    assert nowhere.returncode == 2 and "partition 0 of 'acme/web/c' has no segment 999" in \
        nowhere.stderr, nowhere.stderr
    piped = subprocess.run(f"{sys.executable} -m tierstream consume acme/web/c | head -1",
                           shell=True, capture_output=True, text=True, env={**env},
                           executable="/bin/bash")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m tierstream "
                           "consume acme/web/c | head -1 >/dev/null"], env=env).returncode == 0
    port = (broker.url or "").rsplit(":", 1)[1]
    no_port = run("topic", "list", "--broker", "grpc://127.0.0.1", env=env)
    assert ":6651" in no_port.stderr or no_port.returncode == 0, no_port.stderr
    assert ":443" not in no_port.stderr
    assert run("topic", "list", "--broker", f"grpc://127.0.0.1:{port}").returncode == 0
    examples = Path(__file__).resolve().parents[2] / "examples"
    run("topic", "create", "acme/web/orders", env=env)
    run("schema", "set", "acme/web/orders", "--type", "avro", "--file",
        str(examples / "order.avsc"), env=env)
    text = run("produce", "acme/web/orders", stdin='\n{"value": "abc"}\n', env=env)
    assert text.returncode == 2 and "stdin line 2" in text.stderr \
        and "the topic has an Avro schema" in " ".join(text.stderr.split()), text.stderr
    assert "message 0" not in text.stderr
    # a sealed partition's new open segment is empty: no split of 0 entries for it
    assert run("seal", "acme/web/c", env=env).returncode == 0
    planned = run("plan", "acme/web/c", "--json", "--data-dir", str(broker.data_dir), env=env)
    splits = [json.loads(line) for line in planned.stdout.splitlines()]
    assert splits and all(s["start"] != s["end"] for s in splits), planned.stdout
    now = run("topic", "set", "acme/web/c", "--retention", "0", env=env)
    assert now.returncode == 2 and "give --yes to confirm" in " ".join(now.stderr.split())
    assert run("topic", "get", "acme/web/c", env=env).stdout.count("none") >= 1
    assert run("topic", "set", "acme/web/c", "--retention", "0", "--yes",
               env=env).returncode == 0


def test_piped_tables_follow_columns_and_end_at_their_last_character(
        broker: BrokerProcess) -> None:
    """Before: 14 of ``broker stats``'s lines piped into a file ended in blanks, and its
    tables were 160 wide whatever COLUMNS said."""
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    run("topic", "create", "acme/web/young", env=env)
    young = run("topic", "stats", "acme/web/young", env=env)  # the broker is seconds old
    assert "s (since the broker started): in" in young.stdout, young.stdout
    for columns, widest in (("", 160), ("100", 100), ("72", 72)):
        shown = run("broker", "stats", env={**env, "COLUMNS": columns})
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert max(len(line) for line in lines) <= widest, shown.stdout
        assert not [line for line in lines if line.endswith(" ")], shown.stdout
