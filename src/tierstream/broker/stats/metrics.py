"""The broker's Prometheus metrics (``broker start --metrics-port``), in Pulsar's names.

Served by ``prometheus_client``'s HTTP server (loopback unless ``--metrics-host`` says
otherwise; HTTPS with the broker's ``--tls-cert``/``--tls-key``), computed at each scrape from
what ``topic_stats.py`` reads, so an idle broker does no work for them:

- per topic and partition: ``tierstream_rate_in`` / ``_rate_out`` (messages/s, last minute),
  ``tierstream_throughput_in`` / ``_throughput_out`` (bytes/s), ``tierstream_in_messages_total``
  / ``_out_messages_total`` and ``..._bytes_total`` (counters since the broker started);
- per topic: ``tierstream_storage_size{location}`` and ``tierstream_storage_messages{location}``
  (open segment, bookies, tier), ``tierstream_producers_count``,
  ``tierstream_subscriptions_count``;
- per subscription: ``tierstream_subscription_back_log``,
  ``tierstream_subscription_unacked_messages``, ``tierstream_subscription_consumers_count``,
  ``tierstream_subscription_oldest_unacked_seconds``;
- the broker: ``tierstream_offload_segments_waiting``,
  ``tierstream_offload_oldest_waiting_seconds``, ``tierstream_bookie_copies_to_delete``,
  ``tierstream_transactions{state}``,
  ``tierstream_partitions_owned{broker}``,
  ``tierstream_recovered_segments``, ``tierstream_replica_failures_total``,
  ``tierstream_checksum_failures_total{bookie}``, ``tierstream_streams{kind}``,
  ``tierstream_under_replicated_segments`` (``managed_ledger/bookies/repair.py``),
  ``..._one_copy_segments``,
  ``..._no_copy_segments``, ``tierstream_re_replicated_segments_total``,
  ``tierstream_bookie_available{bookie}``, ``tierstream_ledger_files_open{bookie}``;
- Spark queries that report their lag (``spark_adapter.watch_lag``):
  ``tierstream_query_lag_messages{query, query_id, topic, partition}``;
- the process: ``process_open_fds``, CPU and memory (``prometheus_client``'s own).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tierstream.broker.stats.topic_stats import (
    QueryLags,
    Streams,
    broker_stats,
    storage_of,
    subscription_stats,
)
from tierstream.errors import ConfigError

if TYPE_CHECKING:
    from tierstream.broker.store import Store
    from tierstream.broker.subscriptions.registry import Subscriptions

__all__ = ["MetricsServer"]

log = logging.getLogger(__name__)


class _Collector:
    """Builds every tierstream metric when Prometheus scrapes (prometheus_client's
    custom-collector protocol: ``collect`` yields metric families)."""

    def __init__(self, store: Store, subscriptions: Subscriptions, streams: Streams,
                 lags: QueryLags) -> None:
        self.store, self.subscriptions, self.streams, self.lags = (store, subscriptions,
                                                                   streams, lags)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"tierstream_{name}", doc, labels=labels)

        tp = ["topic", "partition"]
        rate_in = gauge("rate_in", "Messages per second written, last minute", tp)
        rate_out = gauge("rate_out", "Messages per second the broker streamed to readers and "
                                     "consumers, last minute", tp)
        thr_in = gauge("throughput_in", "Bytes per second written, last minute", tp)
        thr_out = gauge("throughput_out", "Bytes per second streamed out, last minute", tp)
        in_total = CounterMetricFamily("tierstream_in_messages", "Messages written", labels=tp)
        out_total = CounterMetricFamily("tierstream_out_messages", "Messages streamed out",
                                        labels=tp)
        in_bytes = CounterMetricFamily("tierstream_in_bytes", "Bytes written", labels=tp)
        out_bytes = CounterMetricFamily("tierstream_out_bytes", "Bytes streamed out", labels=tp)
        size = gauge("storage_size", "Bytes stored, by location (open, bookies, tier)",
                     ["topic", "location"])
        stored = gauge("storage_messages", "Messages stored, by location",
                       ["topic", "location"])
        producers = gauge("producers_count", "Producer streams attached", ["topic"])
        subs_count = gauge("subscriptions_count", "Subscriptions", ["topic"])
        ts = ["topic", "subscription"]
        backlog = gauge("subscription_back_log", "Messages not acknowledged yet", ts)
        unacked = gauge("subscription_unacked_messages", "Messages delivered and not "
                                                         "acknowledged", ts)
        consumers = gauge("subscription_consumers_count", "Consumers attached", ts)
        oldest = gauge("subscription_oldest_unacked_seconds", "Age of the oldest message "
                                                              "delivered and not acknowledged", ts)
        live = self.streams.current()
        for topic in self.store.topics():
            plogs = self.store.partitions(topic.name)
            for plog in plogs:
                labels = [topic.name, str(plog.partition)]
                (mi, bi), (mo, bo) = plog.rate_in.rate(), plog.rate_out.rate()
                rate_in.add_metric(labels, mi)
                rate_out.add_metric(labels, mo)
                thr_in.add_metric(labels, bi)
                thr_out.add_metric(labels, bo)
                in_total.add_metric(labels, plog.rate_in.messages_total)
                out_total.add_metric(labels, plog.rate_out.messages_total)
                in_bytes.add_metric(labels, plog.rate_in.bytes_total)
                out_bytes.add_metric(labels, plog.rate_out.bytes_total)
            storage = storage_of([s for p in plogs for s in p.segments()])
            for location, figures in storage.items():
                size.add_metric([topic.name, location], figures["bytes"])
                stored.add_metric([topic.name, location], figures["messages"])
            producers.add_metric([topic.name], sum(
                1 for s in live if s["topic"] == topic.name and s["kind"] == "producer"))
            subs = subscription_stats(self.subscriptions.listing(topic.name))
            subs_count.add_metric([topic.name], len(subs))
            for name, sub in subs.items():
                labels = [topic.name, name]
                backlog.add_metric(labels, sub["backlog"])
                unacked.add_metric(labels, sub["unacked"])
                consumers.add_metric(labels, len(sub["consumers"]))
                oldest.add_metric(labels, sub["oldest_unacked_s"] or 0.0)
        yield from (rate_in, rate_out, thr_in, thr_out, in_total, out_total, in_bytes,
                    out_bytes, size, stored, producers, subs_count, backlog, unacked,
                    consumers, oldest)
        yield from self._broker()
        yield from self._lags()
        yield from self._tier_cache()

    def _broker(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = {**self.store.stats(), **broker_stats(self.store, self.streams)}
        offload = stats["offload"]
        yield GaugeMetricFamily("tierstream_offload_segments_waiting",
                                "Sealed segments an offload policy has not moved yet",
                                value=offload["segments_waiting"])
        yield GaugeMetricFamily("tierstream_offload_oldest_waiting_seconds",
                                "How long the oldest of them has been sealed",
                                value=offload["oldest_waiting_s"] or 0.0)
        yield GaugeMetricFamily("tierstream_bookie_copies_to_delete",
                                "Offloaded segments whose bookie copy waits for the "
                                "deletion lag", value=offload["bookie_copies_to_delete"])
        txns = GaugeMetricFamily("tierstream_transactions", "Transactions by state",
                                 labels=["state"])
        for state, n in stats["transactions"].items():
            txns.add_metric([state], n)
        yield txns
        streams = GaugeMetricFamily("tierstream_streams", "Streams the broker serves, by kind",
                                    labels=["kind"])
        for kind, n in stats["streams"].items():
            streams.add_metric([kind], n)
        yield streams
        owned = GaugeMetricFamily("tierstream_partitions_owned",
                                  "Partitions each broker owns (metadata/ownership.py)",
                                  labels=["broker"])
        lease = GaugeMetricFamily("tierstream_broker_lease_age_seconds",
                                  "Since each broker last renewed its lease, by the metadata "
                                  "server's clock", labels=["broker"])
        for b in stats["brokers"]:
            owned.add_metric([b["broker"]], b["partitions"])
            if b["heard_ms_ago"] is not None:
                lease.add_metric([b["broker"]], max(0, b["heard_ms_ago"]) / 1000)
        yield owned
        yield lease
        yield GaugeMetricFamily("tierstream_recovered_segments",
                                "Segments sealed by crash recovery when the broker started",
                                value=len(stats["recovered_segments"]))
        yield CounterMetricFamily("tierstream_replica_failures",
                                  "Entry reads that fell back to another replica",
                                  value=stats["replica_failures"])
        replication = stats["replication"]
        for name, key, text in (
                ("under_replicated_segments", "under_replicated",
                 "Closed segments lacking a whole copy on a bookie of their ensemble"),
                ("one_copy_segments", "one_copy",
                 "Segments down to one whole copy on the bookies that answer"),
                ("no_copy_segments", "no_copy",
                 "Segments with no whole copy on a bookie that answers")):
            yield GaugeMetricFamily(f"tierstream_{name}", text, value=replication[key])
        yield CounterMetricFamily("tierstream_re_replicated_segments",
                                  "Segments re-replicated since the broker started",
                                  value=replication["re_replicated"])
        available = GaugeMetricFamily("tierstream_bookie_available",
                                      "1 while a bookie takes writes", labels=["bookie"])
        read_files = GaugeMetricFamily("tierstream_ledger_files_open",
                                       "Ledger files a bookie of this process holds open for "
                                       "reads (shared by them; bounded by maxOpenLedgers)",
                                       labels=["bookie"])
        for bookie, state in stats["bookies"].items():
            available.add_metric([bookie], 1 if state["available"] else 0)
            if "read_files" in state:
                read_files.add_metric([bookie], state["read_files"])
        yield available
        yield read_files
        checksums = CounterMetricFamily("tierstream_checksum_failures",
                                        "Frames that failed their checksum", labels=["bookie"])
        for bookie, n in stats["checksum_failures"].items():
            checksums.add_metric([bookie], n)
        yield checksums

    def _tier_cache(self) -> Iterator[Any]:
        """This host's tier cache (shared by every reader on the host, so its counts are the
        host's), when the store's tier is remote and the cache is on."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from tierstream.tier.host_cache import host_cache

        tier = self.store.tier
        cache = host_cache() if tier is not None and tier.scheme != "file" else None
        if cache is None:
            return
        stats = cache.stats()
        for name, value, text in (
                ("hits", stats.hits, "Tier file blocks served from this host's tier cache"),
                ("misses", stats.misses, "Tier file blocks fetched from the object store"),
                ("hit_bytes", stats.hit_bytes, "Bytes served from the tier cache"),
                ("miss_bytes", stats.miss_bytes, "Bytes fetched from the object store"),
                ("evictions", stats.evictions, "Blocks evicted from the tier cache"),
                ("rejected", stats.rejected, "Blocks fetched but not kept (read less often "
                                             "than what they would evict)"),
                ("corrupt", stats.corrupt, "Cached blocks dropped for a bad checksum")):
            yield CounterMetricFamily(f"tierstream_tier_cache_{name}", text, value=value)
        yield GaugeMetricFamily("tierstream_tier_cache_bytes", "Bytes the tier cache holds",
                                value=stats.size)
        yield GaugeMetricFamily("tierstream_tier_cache_limit_bytes",
                                "The most bytes the tier cache holds", value=stats.limit)

    def _lags(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        lag = GaugeMetricFamily(
            "tierstream_query_lag_messages", "Messages between a Spark query's last committed "
            "offsets and the latest positions (spark_adapter.watch_lag)",
            labels=["query", "query_id", "topic", "partition"])
        for query_id, report in self.lags.current().items():
            for topic, parts in report["lags"].items():
                for partition, n in parts.items():
                    lag.add_metric([report["name"] or "", query_id, topic, str(partition)], n)
        yield lag


class MetricsServer:
    """The HTTP endpoint Prometheus scrapes, on a thread of its own."""

    def __init__(self, store: Store, subscriptions: Subscriptions, streams: Streams,
                 lags: QueryLags, *, host: str, port: int, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector

        from tierstream.wire.security import is_loopback

        registry = CollectorRegistry()
        registry.register(_Collector(store, subscriptions, streams, lags))
        ProcessCollector(registry=registry)
        try:
            self._server, self._thread = start_http_server(
                port, addr=host, registry=registry, certfile=tls_cert, keyfile=tls_key)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: "
                              f"{exc.strerror or exc}") from None
        self.port = int(self._server.server_address[1])
        self.scheme = "https" if tls_cert else "http"
        self.url = f"{self.scheme}://{host}:{self.port}/metrics"
        if not is_loopback(host):
            log.warning("metrics are served on %s without a token: they name topics and "
                        "subscriptions (not their data)", self.url)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
