"""The end-to-end tour behind ``make demo``: a real broker process on a fresh data directory.

It starts a broker, creates a topic with 4 partitions, produces a week of synthetic clickstream
with historical publish times (small segments, so several roll over), offloads the oldest
segments so data lives in all three places, shows the segment table, reads a window and a key
range through the broker, prints the plan of a backfill, runs it on Spark, reads with 8 key
ranges over 4 partitions on Spark, runs a streaming tail with AvailableNow while producing,
tails a subscription, and stops everything cleanly. Every check is real: a mismatch fails the
demo with a non-zero exit status.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer, read
from tierstream.errors import TierstreamError
from tierstream.model.message_format import key_hash
from tierstream.model.positions import KeyRange, Offset
from tierstream.util.timeutil import format_ms, now_ms, parse_time_ms

TOPIC = "acme/web/clicks"
WEEK_START = parse_time_ms("2026-11-01T00:00:00Z")
DAY = 86_400_000


def run(data_dir: Path | None = None, messages: int = 200_000, keys: int = 500,
        console: Console | None = None) -> None:
    """The tour; ``console`` (default: stdout) gets its report."""
    console = console or Console(soft_wrap=True)
    keep = data_dir is not None
    root = data_dir or Path(tempfile.mkdtemp(prefix="tierstream-demo-"))
    step = 7 * DAY // messages
    console.rule("[bold]tierstream demo: the embedded store, end to end")
    console.print(f"data directory: {root}")
    t_start = time.perf_counter()
    broker = BrokerProcess(root, args=["--max-entries-per-segment", "20",
                                       "--deletion-lag", "0s"]).start()
    try:
        assert broker.url is not None
        console.print(f"1. broker started at {broker.url} (pid {broker.proc and broker.proc.pid})")
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 4)
            console.print(f"2. created {TOPIC} with 4 partitions")

            produced_keys: list[str] = []
            t0 = time.perf_counter()
            with Producer(TOPIC, broker=broker.url, name="demo") as producer:
                batch = []
                for i in range(messages):
                    key = f"user-{(i * 7919) % keys:05d}"
                    produced_keys.append(key)
                    t = WEEK_START + i * step
                    batch.append({"value": f'{{"user":"{key}","n":{i}}}'.encode(), "key": key,
                                  "publish_time": t, "event_time": t})
                    if len(batch) == 20_000:
                        producer.send_many(batch)
                        batch = []
                if batch:
                    producer.send_many(batch)
            dt = time.perf_counter() - t0
            console.print(f"3. produced {messages:,} clicks from {format_ms(WEEK_START)} over 7 "
                          f"days in {dt:.2f}s ({messages / dt:,.0f} msg/s)")

            cutoff = WEEK_START + 3 * DAY  # segments whose newest message is before this move
            moved = admin.offload(TOPIC, older_than_ms=now_ms() - cutoff)
            console.print(f"4. offloaded {len(moved)} segment(s) with data older than "
                          f"{format_ms(cutoff)} to Parquet in the tier, "
                          "registered in Iceberg")

            segments = admin.list_segments(TOPIC)
            table = Table("partition", "segment", "state", "entries", "messages",
                          "min publish time", "max publish time", "lives in",
                          title="5. segments: tier (Parquet), bookies (closed), open (tail)")
            for s in segments:
                table.add_row(str(s.partition), str(s.segment_id), s.state, str(s.entries),
                              str(s.messages), format_ms(s.min_publish_time),
                              format_ms(s.max_publish_time), s.location)
            console.print(table)

            lo_t, hi_t = WEEK_START + 2 * DAY, WEEK_START + 3 * DAY
            expected = sum(1 for i in range(messages) if lo_t <= WEEK_START + i * step < hi_t)
            got = sum(b.num_rows for b in read(TOPIC, start=Offset.at_time(lo_t),
                                               end=Offset.at_time(hi_t), broker=broker.url))
            _check(console, f"6. one-day window {format_ms(lo_t)} .. {format_ms(hi_t)}",
                   got, expected)

            quarter = KeyRange(0, 16384)
            expected = sum(1 for k in produced_keys if quarter.contains(key_hash(k)))
            got = sum(b.num_rows for b in read(TOPIC, key_ranges=[quarter],
                                               end=Offset.latest(), broker=broker.url))
            _check(console, f"7. key range {quarter} (a quarter of the Key_Shared slots)",
                   got, expected)

            spark_part(console, root, broker.url, lo_t, hi_t, messages, step)

            with Consumer(TOPIC, "demo-tail", broker=broker.url) as consumer, \
                    Producer(TOPIC, broker=broker.url) as producer:
                t0 = time.perf_counter()
                producer.send_many({"value": b"live", "key": f"live-{i}"} for i in range(100))
                seen = 0
                deadline = time.monotonic() + 10
                while seen < 100 and time.monotonic() < deadline:
                    b = consumer.receive(timeout=1)
                    if b is not None:
                        seen += b.num_rows
                        consumer.ack(b)
                _check(console, f"12. tail subscription got the live messages in "
                       f"{(time.perf_counter() - t0) * 1000:.0f} ms", seen, 100)
    finally:
        status = broker.stop()
    console.print(f"13. broker stopped cleanly (exit {status}); open segments were sealed")
    if status != 0:
        raise SystemExit(f"broker exited with status {status}")
    console.rule(f"[green]demo passed in {time.perf_counter() - t_start:.1f}s")
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


def spark_part(console: Console, root: Path, url: str, lo_t: int, hi_t: int, messages: int,
               step: int) -> None:
    """Steps 8-11: the plan of a backfill, the backfill on Spark, a key-range parallel read
    and a streaming tail with AvailableNow while producing."""
    import tierstream as ts
    from tierstream.spark_adapter import register
    from tierstream.spark_adapter.jobs import backfill, local_spark, stop_spark

    splits = ts.plan(TOPIC, start=lo_t, end=hi_t + 2 * DAY, data_dir=str(root), broker=url)
    table = Table("split", "reader", "key range", title="8. plan of the backfill "
                  f"{format_ms(lo_t)} .. {format_ms(hi_t + 2 * DAY)}")
    for sp in splits:
        table.add_row(sp.split_id, sp.reader.value, str(sp.key_range))
    console.print(table)
    spark = local_spark("tierstream-demo")
    try:
        register(spark)
        opts = {"topic": TOPIC, "dataDir": str(root), "broker": url}
        result = backfill(spark, {**opts, "startingTime": str(lo_t),
                                  "endingTime": str(hi_t + 2 * DAY)},
                          str(root / "demo-backfill"), format="iceberg")
        expected = sum(1 for i in range(messages)
                       if lo_t <= WEEK_START + i * step < hi_t + 2 * DAY)
        readers = ", ".join(f"{k} {v}" for k, v in sorted(result.splits_by_reader.items()))
        _check(console, f"9. backfill on Spark into Iceberg table {result.table} "
               f"({readers} splits as Spark partitions, {result.seconds:.1f}s)",
               result.rows, expected)
        cut = ts.latest_cut(TOPIC, data_dir=str(root), broker=url)
        df8 = spark.read.format("tierstream").options(**opts, keyRanges="8",
                                                      endingPosition=cut.to_json()).load()
        _check(console, f"10. key-range parallel read: 8 key ranges over 4 partitions "
               f"({df8.rdd.getNumPartitions()} Spark partitions: segments x key ranges)",
               df8.count(), messages)
        live = [f"live-{i}" for i in range(3000)]
        with Producer(TOPIC, broker=url, name="demo-live") as producer:
            producer.send_many({"value": v.encode(), "key": v} for v in live[:2000])
            more = threading.Thread(target=producer.send_many, args=(
                [{"value": v.encode(), "key": v} for v in live[2000:]],))
            more.start()  # keeps producing while the streaming query runs
            out = root / "demo-stream"
            query = (spark.readStream.format("tierstream")
                     .options(**opts, startingPosition=cut.to_json(),
                              maxRecordsPerTrigger="700").load()
                     .writeStream.format("parquet")
                     .option("checkpointLocation", str(root / "demo-ckpt"))
                     .trigger(availableNow=True).start(str(out)))
            query.awaitTermination(300)
            more.join()
        rows = [bytes(r["value"]).decode()
                for r in spark.read.parquet(str(out)).select("value").collect()]
        batches = sum(1 for p in query.recentProgress if p["numInputRows"])
        ok = len(rows) == len(set(rows)) and set(live[:2000]) <= set(rows) <= set(live)
        console.print(f"11. streaming tail, AvailableNow while producing: {len(rows):,} new "
                      f"messages in {batches} micro-batches, none twice, none from before the "
                      f"cut {'[green]ok[/green]' if ok else '[red]MISMATCH[/red]'}")
        if not ok:
            raise TierstreamError("demo check failed: streaming tail")
    finally:
        stop_spark(spark)


def _check(console: Console, what: str, got: int, expected: int) -> None:
    mark = "[green]ok[/green]" if got == expected else "[red]MISMATCH[/red]"
    console.print(f"{what}: {got:,} messages, expected {expected:,} {mark}")
    if got != expected:
        raise TierstreamError(f"demo check failed: {what}: got {got}, expected {expected}")
