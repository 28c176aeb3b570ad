"""The tier through a real broker process: policies, the offload command, reads after moves."""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa

from tierstream.client import Admin, Producer
from tierstream.model.positions import Offset

from .. import forkserver
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/web/clicks"
BASE = 1_793_491_200_000  # 2026-11-01T00:00:00Z: older than a day by the time this runs


def _produce_history(url: str, n: int = 3000) -> list[bytes]:
    values = [f"m{i}".encode() for i in range(n)]
    with Producer(TOPIC, broker=url, batch_size=100) as producer:
        producer.send_many({"value": v, "key": f"k{i % 17}", "publish_time": BASE + i * 60_000}
                           for i, v in enumerate(values))
    return values


def test_broker_offloads_old_segments_and_still_serves_them(start_broker) -> None:
    broker = start_broker("--max-entries-per-segment", "5", "--offload-after", "1d",
                          "--deletion-lag", "0s", "--tier-check-interval", "200ms")
    # the policy is echoed in words at start, where a wrong unit shows before data moves
    assert "offload to the tier: closed segments whose newest message is older than 1 day; " \
        "bookie copies deleted 0 seconds after; checked every 200 milliseconds" in \
        "".join(broker.stdout_lines)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        values = _produce_history(broker.url)
        admin.seal(TOPIC)

        def all_moved() -> bool:
            segs = [s for s in admin.list_segments(TOPIC) if s.state == "CLOSED"]
            return bool(segs) and all(s.bookie_deleted_at is not None for s in segs)

        wait_for(all_moved, timeout=scaled(60),
                 what="every closed segment offloaded and bookie-free")
        assert {s.location for s in admin.list_segments(TOPIC)} == {"tier", "open"}
    got = read_all(broker.url, TOPIC).column("value").to_pylist()
    assert sorted(got) == sorted(values)
    # time-based reads binary-search tiered segments too
    window = read_all(broker.url, TOPIC, start=__import__("tierstream").Offset.at_time(
        BASE + 1000 * 60_000))
    assert len(window) == 2000


def test_the_latest_positions_are_answered_while_the_tier_is_away(start_broker, data_dir
                                                                   ) -> None:
    """Regression: when a partition's open segment was empty (sealed, or just rolled), its
    end was taken from the last closed segment's index, and the index of a segment that
    lives only in the tier is its whole Parquet file: a tail, a subscription or a Spark
    stream starting at ``latest`` read the file (a whole object from S3, with the
    partition's lock held), and failed while the tier was away, though it reads no data."""
    broker = start_broker("--max-entries-per-segment", "5", "--offload-after", "1d",
                          "--deletion-lag", "0s", "--tier-check-interval", "200ms")
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        _produce_history(broker.url, 600)
        sealed = admin.seal(TOPIC)

        def all_moved() -> bool:
            segs = [s for s in admin.list_segments(TOPIC) if s.state == "CLOSED"]
            return bool(segs) and all(s.bookie_deleted_at is not None for s in segs)

        wait_for(all_moved, timeout=scaled(60),
                 what="every closed segment offloaded and bookie-free")
        (data_dir / "tier").rename(data_dir / "tier-away")  # the tier is unreachable now
        cut = admin.latest_cut(TOPIC)
        assert {p: (e.segment_id, e.entry_id, e.batch_index) for p, e in cut.positions} == {
            s.partition: (s.segment_id, s.entries, 0) for s in sealed}
        with Producer(TOPIC, broker=broker.url) as producer:  # a read from there gets what
            producer.send_many([{"value": b"after", "key": "k1"}])  # comes after
        got = [v for p, end in cut.positions for v in read_all(
            broker.url, TOPIC, start=Offset.at_position(end)).column("value").to_pylist()]
        assert got == [b"after"]


def test_offload_command_and_segment_table(start_broker, data_dir) -> None:
    broker = start_broker("--max-entries-per-segment", "10")
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
        _produce_history(broker.url, 2500)
    env = {**os.environ, "TIERSTREAM_BROKER": broker.url, "TIERSTREAM_HOME": str(data_dir)}
    run = [sys.executable, "-m", "tierstream"]
    proc = forkserver.run([*run, "offload", TOPIC, "--older-than", "1d"], env=env,
                          capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    assert "offloaded 2 closed segment(s) whose newest message is older than 1 day" in proc.stdout
    table = forkserver.run([*run, "segments", TOPIC, "--json"], env=env, capture_output=True,
                           text=True, timeout=scaled(60))
    records = json.loads(table.stdout)
    assert [r["location"] for r in records] == ["tier", "tier", "open"]
    assert records[0]["tier_url"].startswith((data_dir / "tier").resolve().as_uri())
    bad = forkserver.run([*run, "offload", TOPIC, "--older-than", "a while"], env=env,
                         capture_output=True, text=True, timeout=scaled(60))
    assert bad.returncode == 2 and "invalid --older-than 'a while'" in bad.stderr


def test_broker_offloads_to_s3(start_broker, s3_bucket, moto_endpoint) -> None:
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_REGION")}
    broker = start_broker("--max-entries-per-segment", "10", "--tier-url",
                          f"s3://{s3_bucket}/tier", "--s3-endpoint", moto_endpoint,
                          "--deletion-lag", "0s", "--metrics-port", "0", env=env)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
        values = _produce_history(broker.url, 2500)
        moved = admin.offload(TOPIC)
        assert len(moved) == 2 and all(s.tier_url and s.tier_url.startswith(f"s3://{s3_bucket}")
                                       for s in moved)
        assert all(s.bookie_deleted_at is not None for s in admin.list_segments(TOPIC)
                   if s.state == "CLOSED")
    table = read_all(broker.url, TOPIC)
    assert table.column("value").to_pylist() == values
    assert isinstance(table, pa.Table)
    # the broker read its tier files (their positions) through the host's tier cache, and
    # says so in its metrics
    from ..spark_adapter.test_lag import scrape

    banner = "".join(broker.stdout_lines)
    samples = scrape(banner.split("metrics: ", 1)[1].split()[0])
    assert samples["tierstream_tier_cache_misses_total"][0].value >= 1
    assert samples["tierstream_tier_cache_bytes"][0].value > 0
