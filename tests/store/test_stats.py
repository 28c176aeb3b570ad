"""Seeing what the store is doing: topic stats (rates, storage by location, producers,
subscriptions) and the broker-wide view, through the Python API and the CLI, on real
brokers."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import threading
import time

import pyarrow as pa

from tierstream.client import Admin, Consumer, Producer, Transaction
from tierstream.managed_ledger.rates import RateMeter
from tierstream.model.positions import Offset

from ..cli.test_cli import run
from ..logs import running_log
from ..signals import tierstream_ignoring_sigint
from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/stats/clicks"


def test_a_rate_meter_averages_the_last_minute() -> None:
    now = [1000.0]
    meter = RateMeter(clock=lambda: now[0])
    now[0] += 10
    meter.add(500, 5000)
    assert meter.rate() == (50.0, 500.0)  # started 10 s ago: over 10 s
    assert meter.window_s() == 10.0  # and stats say so (topic stats: "last 10 s")
    now[0] += 50
    meter.add(100, 1000)
    assert meter.rate() == (10.0, 100.0)  # 600 messages in the last 60 s
    now[0] += 30
    assert meter.rate() == (100 / 60, 1000 / 60)  # the first add left the window
    assert (meter.messages_total, meter.bytes_total) == (600, 6000)


def test_topic_stats_show_rates_storage_producers_and_subscriptions(tmp_path) -> None:
    with running_log(tmp_path / "data") as log, Admin(log.url) as admin:
        admin.create_topic(TOPIC, 2)
        producer = Producer(TOPIC, broker=log.url, name="clicks-writer", batch_size=100)
        consumer = Consumer(TOPIC, "billing", mode="shared",
                            initial=Offset.earliest(), broker=log.url)
        try:
            producer.send_many({"key": f"k{i}", "value": b"x" * 100} for i in range(1000))
            producer.flush()
            log.store.seal(TOPIC, 0)
            log.store.offloader.offload_topic(TOPIC)  # partition 0's sealed segment
            got = 0
            while got < 300:
                batch = consumer.receive(timeout=scaled(30))
                assert batch is not None
                got += batch.num_rows  # received, not acknowledged
            wait_for(lambda: admin.topic_stats(TOPIC)["subscriptions"]["billing"]["unacked"]
                     >= got, what="the broker to count the delivered messages")
            stats = admin.topic_stats(TOPIC, per_partition=True)
        finally:
            consumer.close()
            producer.close()
    assert stats["topic"] == TOPIC and stats["partition_count"] == 2
    assert stats["msg_rate_in"] > 0 and stats["byte_rate_in"] > 100 * stats["msg_rate_in"]
    assert stats["msg_rate_out"] > 0
    storage = stats["storage"]
    assert sum(s["messages"] for s in storage.values()) == 1000
    assert storage["tier"]["segments"] == 1 and storage["tier"]["messages"] > 0
    assert storage["open"]["messages"] > 0
    assert [p["name"] for p in stats["producers"]] == ["clicks-writer"] * 2
    assert sum(p["messages"] for p in stats["producers"]) == 1000
    billing = stats["subscriptions"]["billing"]
    assert billing["type"] == "shared" and billing["consumers"] == [consumer.name]
    assert billing["unacked"] >= got and billing["backlog"] == 1000
    assert billing["oldest_unacked_s"] is not None and billing["oldest_unacked_s"] >= 0
    parts = stats["partitions"]
    assert [p["partition"] for p in parts] == [0, 1]
    assert sum(p["storage"]["tier"]["messages"] for p in parts) == storage["tier"]["messages"]
    assert sum(p["subscriptions"]["billing"]["backlog"] for p in parts) == 1000


def test_broker_stats_count_streams_transactions_and_offload_lag(tmp_path) -> None:
    with running_log(tmp_path / "data", offloadAfter="1h") as log, Admin(log.url) as admin:
        admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=log.url) as producer:
            producer.send(b"one")
            wait_for(lambda: admin.stats()["streams"]["producer"] == 1,
                     what="the producer's stream to be counted")
        log.store.seal(TOPIC)
        txn = Transaction(broker=log.url)
        try:
            txn.write(TOPIC, pa.table({"value": [b"t"]}))
            txn.prepare()
            time.sleep(0.05)  # an age above zero for the sealed segment
            stats = admin.stats()
        finally:
            txn.abort()
    assert stats["topics"] == 1 and stats["partitions"] == 1
    assert stats["transactions"]["PREPARED"] == 1
    assert stats["offload"]["policy"] is True and stats["offload"]["segments_waiting"] == 1
    assert stats["offload"]["oldest_waiting_s"] > 0
    assert stats["open_files"] > 0 and stats["uptime_s"] > 0


def test_the_cli_prints_topic_and_broker_stats(broker) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    assert run("topic", "create", TOPIC, "--partitions", "2", env=env).returncode == 0
    assert run("produce", TOPIC, "--generate", "200", env=env).returncode == 0
    with Consumer(TOPIC, "audit", initial=Offset.earliest(), broker=broker.url) as consumer:
        assert consumer.receive(timeout=scaled(30)) is not None
        table = run("topic", "stats", TOPIC, "--per-partition", env=env)
        as_json = run("topic", "stats", TOPIC, "--json", env=env)
    assert table.returncode == 0, table.stderr
    assert "audit" in table.stdout and "stored in" in table.stdout
    assert "partition 1:" in table.stdout
    doc = json.loads(as_json.stdout)
    assert doc["subscriptions"]["audit"]["backlog"] == 200
    assert sum(s["messages"] for s in doc["storage"].values()) == 200
    both = run("topic", "stats", TOPIC, "--json", "--watch", env=env)
    assert both.returncode == 2 and both.stderr.count("\n") == 1 and "--watch" in both.stderr
    missing = run("topic", "stats", "acme/stats/nope", env=env)
    assert missing.returncode == 2 and "nope" in missing.stderr
    assert missing.stderr.count("\n") == 1
    brk = run("broker", "stats", env=env)
    assert brk.returncode == 0 and "open files" in brk.stdout
    # the bookies and the replication state are in the table, not only in --json
    assert "bookie bookie-0" in brk.stdout and "available" in brk.stdout, brk.stdout
    assert "0 segment(s) lacking a copy" in brk.stdout, brk.stdout
    assert json.loads(run("broker", "stats", "--json", env=env).stdout)["topics"] == 1


def test_the_broker_serves_prometheus_metrics_when_asked(start_broker, free_port) -> None:
    from ..spark_adapter.test_lag import scrape

    broker = start_broker("--metrics-port", "0")
    banner = "".join(broker.stdout_lines)
    assert "metrics: http://127.0.0.1:" in banner
    url = banner.split("metrics: ", 1)[1].split()[0]
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=broker.url, name="m") as producer:
        producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(500))
        producer.flush()
        with Consumer(TOPIC, "dash", initial=Offset.earliest(), broker=broker.url) as consumer:
            assert consumer.receive(timeout=scaled(30)) is not None
            wait_for(lambda: sum(s.value for s in scrape(url).get(
                "tierstream_subscription_unacked_messages", [])) > 0,
                what="the delivered messages in the metrics")
            samples = scrape(url)
    assert sum(s.value for s in samples["tierstream_in_messages_total"]) == 500
    (owned,) = samples["tierstream_partitions_owned"]
    assert owned.value == 2 and owned.labels["broker"].startswith("broker-")
    assert {s.labels["partition"] for s in samples["tierstream_rate_in"]
            if s.labels["topic"] == TOPIC} == {"0", "1"}
    assert sum(s.value for s in samples["tierstream_rate_in"]) > 0
    assert [s.value for s in samples["tierstream_producers_count"]
            if s.labels["topic"] == TOPIC] == [2.0]  # one stream per partition
    backlog = {s.labels["subscription"]: s.value
               for s in samples["tierstream_subscription_back_log"]}
    assert backlog == {"dash": 500.0}
    assert {s.labels["location"] for s in samples["tierstream_storage_size"]} == {
        "open", "bookies", "tier"}
    assert samples["tierstream_offload_segments_waiting"][0].value == 0
    assert samples["tierstream_under_replicated_segments"][0].value == 0
    assert {s.labels["bookie"]: s.value for s in samples["tierstream_bookie_available"]} == {
        "bookie-0": 1.0}
    assert samples["process_open_fds"][0].value > 0
    # a port in use is one line, naming it
    taken = run("broker", "start", "--data-dir", str(broker.data_dir) + "-2", "--port", "0",
                "--metrics-port", url.rsplit(":", 1)[1].split("/")[0])
    assert taken.returncode != 0 and taken.stderr.count("\n") == 1, taken.stderr
    assert "metrics" in taken.stderr or "in use" in taken.stderr


def test_topic_stats_watch_refreshes_in_place_until_interrupted(broker) -> None:
    """``--watch`` on a terminal: the table is redrawn (a backlog that grows shows up without
    a new command) and Ctrl-C ends it cleanly."""
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    topic = "acme/stats/watched"
    assert run("topic", "create", topic, env=env).returncode == 0
    with Producer(topic, broker=broker.url) as producer:
        producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(200))
        producer.flush()
        with Consumer(topic, "audit", initial=Offset.earliest(), broker=broker.url):
            master, slave = pty.openpty()
            proc = subprocess.Popen(
                tierstream_ignoring_sigint("topic", "stats", topic, "--watch", "--interval",
                                           "100ms"), stdout=slave, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env, "TERM": "xterm-256color", "COLUMNS": "150"})
            os.close(slave)
            drawn = [b""]

            def shows(text: bytes) -> bool:
                while select.select([master], [], [], 0.05)[0]:
                    drawn[0] += os.read(master, 65536)
                return text in drawn[0]

            try:
                wait_for(lambda: shows(b"audit"), timeout=scaled(30))
                producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(300))
                producer.flush()
                # the subscription's row redrawn with backlog 200 -> 500 (a bare "500" can be
                # part of any other figure of the first frame)
                wait_for(lambda: shows(b"audit") and re.search(
                    rb"audit\s+exclusive\s+500\s", drawn[0]) is not None, timeout=scaled(30))
                proc.send_signal(signal.SIGINT)
                assert proc.wait(timeout=scaled(30)) == 0, proc.stderr.read()  # type: ignore
            finally:
                proc.kill()
                os.close(master)
    assert drawn[0].count(b"stored in") >= 2


def test_topic_stats_watch_into_a_pipe_prints_a_frame_per_interval(broker) -> None:
    """Regression: into a pipe, ``--watch`` printed one frame and then ran silently."""
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    topic = "acme/stats/piped"
    assert run("topic", "create", topic, env=env).returncode == 0
    proc = subprocess.Popen(
        tierstream_ignoring_sigint("topic", "stats", topic, "--watch", "--interval", "100ms"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, **env})
    frames: list[str] = []
    threading.Thread(target=lambda: frames.extend(
        line for line in proc.stdout or [] if b"stored in" in line), daemon=True).start()
    try:
        wait_for(lambda: len(frames) >= 3, timeout=scaled(30), what="three frames")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=scaled(30)) == 0, proc.stderr.read()  # type: ignore
    finally:
        proc.kill()
