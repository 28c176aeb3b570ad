"""How far a Structured Streaming query is behind the log, per topic and partition.

PySpark's Python data sources get no metrics hook in a query's progress, but a Python
``StreamingQueryListener`` (checked on classic PySpark 4; not tried through Spark Connect) sees each
micro-batch's progress, whose ``sources`` carry the offsets a batch ended at: for a tierstream
source, its stream cuts. :func:`watch_lag` registers one that asks the broker, after every
batch, how many messages lie between those cuts and the latest positions (the ``lag`` action),
and reports it:

- into the log (``tierstream.spark_adapter.lag``, INFO, one line per batch);
- to the broker, whose metrics endpoint exports it as
  ``tierstream_query_lag_messages{query, query_id, topic, partition}``
  (``broker/stats/metrics.py``);
- to ``on_lag``, if given (``tierstream tail`` prints it on its console).

The listener runs in the driver's Python process, on the thread Spark calls listeners from;
it never raises into Spark: a broker it cannot reach is logged and tried again next batch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.streaming import StreamingQueryListener

from tierstream.errors import ConfigError, TierstreamError
from tierstream.splits.split import cuts_from_dict

__all__ = ["LagListener", "QueryLag", "watch_lag"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryLag:
    """One query's lag after one micro-batch."""

    query_id: str
    name: str | None
    batch_id: int
    rows: int
    #: messages after the batch's end offsets: {topic: {partition: messages}}
    lags: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(n for parts in self.lags.values() for n in parts.values())

    def describe(self) -> str:
        """``behind: 1,234 message(s) (acme/web/clicks p0 1,000, p1 234)``."""
        topics = "; ".join(
            f"{t} " * (len(self.lags) > 1) + ", ".join(f"p{p} {n:,}" for p, n in sorted(
                parts.items())) for t, parts in sorted(self.lags.items()))
        return f"behind: {self.total:,} message(s) ({topics})"


class LagListener(StreamingQueryListener):
    """Reports each tierstream query's lag after every micro-batch (see the module)."""

    def __init__(self, *, broker: str, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None, report: bool = True,
                 on_lag: Callable[[QueryLag], None] | None = None) -> None:
        self.broker = broker
        self.auth_token = auth_token
        self.tls_ca = tls_ca
        self.report = report
        self.on_lag = on_lag
        self.latest: dict[str, QueryLag] = {}  # by query id
        self._lock = threading.Lock()
        self._admin: Any = None

    def _client(self) -> Any:
        if self._admin is None:
            from tierstream.client.admin import Admin

            self._admin = Admin(self.broker, auth_token=self.auth_token, tls_ca=self.tls_ca)
        return self._admin

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        cuts: dict[str, Any] = {}
        for source in progress.sources:
            try:
                cuts.update(cuts_from_dict(json.loads(source.endOffset or "null")))
            except (ConfigError, ValueError, TypeError, AttributeError):
                continue  # not a tierstream source (or no offset yet)
        if not cuts:
            return
        query_id, name = str(progress.id), progress.name
        try:
            with self._lock:
                admin = self._client()
                lags = {t: admin.lag(t, dict(c.positions)) for t, c in cuts.items()}
                lag = QueryLag(query_id, name, int(progress.batchId),
                               int(progress.numInputRows), lags)
                self.latest[query_id] = lag
                if self.report:
                    admin.report_query_lag(query_id, name, lags)
        except TierstreamError as exc:
            log.warning("lag of query %s unknown after batch %s: %s", name or query_id,
                        progress.batchId, exc)
            return
        log.info("query %s batch %d: %d row(s); %s", name or query_id, lag.batch_id, lag.rows,
                 lag.describe())
        if self.on_lag is not None:
            try:
                self.on_lag(lag)
            except Exception:  # a callback's bug must not reach Spark's listener bus
                log.exception("the on_lag callback failed")

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        query_id = str(event.id)
        if query_id not in self.latest or not self.report:
            return
        try:
            with self._lock:
                self._client().report_query_lag(query_id, None, None)
        except TierstreamError as exc:
            log.info("could not tell the broker that query %s ended: %s", query_id, exc)

    def close(self) -> None:
        with self._lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None


def watch_lag(spark: Any, *, broker: str | None = None, auth_token: str | None = None,
              tls_ca: bytes | str | None = None, report: bool = True,
              on_lag: Callable[[QueryLag], None] | None = None) -> LagListener:
    """Register a :class:`LagListener` on ``spark`` for every tierstream streaming query it
    runs (``broker``: default ``TIERSTREAM_BROKER`` or the default URL); returns it
    (``spark.streams.removeListener(listener)`` stops it)."""
    import os

    from tierstream.options import DEFAULT_BROKER_URL

    listener = LagListener(broker=broker or os.environ.get("TIERSTREAM_BROKER")
                           or DEFAULT_BROKER_URL, auth_token=auth_token, tls_ca=tls_ca,
                           report=report, on_lag=on_lag)
    spark.streams.addListener(listener)
    return listener
