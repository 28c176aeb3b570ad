"""Lag of Structured Streaming queries, seen by a Python StreamingQueryListener: per batch
in the log and a callback, and as a gauge on the broker's Prometheus endpoint, scraped over
real HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tierstream.broker.stats.metrics import MetricsServer
from tierstream.spark_adapter import register, watch_lag
from tierstream.spark_adapter.lag import QueryLag

from ..logs import TOPIC, fill, running_log
from ..store.helpers import wait_for
from ..timing import scaled

pytestmark = pytest.mark.spark


def scrape(url: str) -> dict[str, list[Any]]:
    """The endpoint's samples by metric name (as Prometheus parses them)."""
    with urllib.request.urlopen(url, timeout=scaled(10)) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_a_query_s_lag_reaches_the_log_a_callback_and_the_metrics(
        spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        total = fill(log, partitions=2, batches=6, keys=7)
        broker = log.broker
        metrics = MetricsServer(log.store, broker.subscriptions, broker.streams, broker.lags,
                                host="127.0.0.1", port=0)
        seen: list[QueryLag] = []
        listener = watch_lag(spark, broker=log.url, on_lag=seen.append)
        try:
            register(spark)
            stream = (spark.readStream.format("tierstream").option("topic", TOPIC)
                      .option("dataDir", str(log.data_dir)).option("broker", log.url)
                      .option("maxRecordsPerTrigger", str(total // 3)).load())
            with caplog.at_level(logging.INFO, logger="tierstream.spark_adapter.lag"):
                query = (stream.writeStream.format("noop").queryName("lagging")
                         .option("checkpointLocation", str(tmp_path / "ckpt"))
                         .trigger(processingTime="200 milliseconds").start())
                try:
                    # listener events arrive after each batch: wait for the one that read
                    # the rest, then scrape while the query still runs
                    wait_for(lambda: any(lag.total == 0 and lag.rows for lag in seen),
                             timeout=scaled(120), what="the last batch's lag")
                    samples = scrape(metrics.url)
                finally:
                    query.stop()
                wait_for(lambda: broker.lags.current() == {}, timeout=scaled(30),
                         what="the ended query's lag to be forgotten")
            batches = [lag for lag in seen if lag.rows]
            assert len(batches) == 3 and sum(lag.rows for lag in batches) == total
            # each batch read a third: what was left after it is the lag it reports
            assert [lag.total for lag in batches] == [total - total // 3 * (i + 1)
                                                      for i in range(3)]
            assert all(set(lag.lags[TOPIC]) == {0, 1} for lag in batches)
            assert batches[0].name == "lagging"
            assert any("query lagging batch" in r.message and "behind:" in r.message
                       for r in caplog.records)
            lag_samples = samples["tierstream_query_lag_messages"]
            assert {(s.labels["query"], s.labels["topic"], s.labels["partition"], s.value)
                    for s in lag_samples} == {("lagging", TOPIC, "0", 0.0),
                                              ("lagging", TOPIC, "1", 0.0)}
            # the rest of the endpoint: what the topic holds and what streamed
            size = {s.labels["location"]: s.value for s in samples["tierstream_storage_messages"]
                    if s.labels["topic"] == TOPIC}
            assert sum(size.values()) == total
            assert sum(s.value for s in samples["tierstream_in_messages_total"]) == total
            assert {s.labels["state"] for s in samples["tierstream_transactions"]} >= {
                "OPEN", "APPLIED"}
            assert samples["process_open_fds"][0].value > 0
        finally:
            spark.streams.removeListener(listener)
            listener.close()
            metrics.shutdown()
