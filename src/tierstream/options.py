"""Every option, declared once: key, type, default, description.

The Spark adapter, the broker's configuration and the clients parse through this table, so an
option has one name and one meaning everywhere. Keys are camelCase (Spark's convention);
:func:`parse_options` turns strings into typed values or raises a
:class:`~tierstream.errors.ConfigError` naming the option and what would be valid. A read's
options parse once into :class:`tierstream.ReadOptions` (``read_options.py``): the Spark
source uses it, and the Python API takes the same keys as ``options=`` (or the same settings
as snake_case keyword arguments).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConfigError
from tierstream.model.names import check_txn_id
from tierstream.util.timeutil import parse_duration_ms
from tierstream.util.units import cache_bytes
from tierstream.util.units import parse_bytes as _size_bytes

__all__ = [
    "DEFAULT_ADMIN_PORT",
    "DEFAULT_ADMIN_TLS_PORT",
    "DEFAULT_BROKER_URL",
    "DEFAULT_DATA_DIR",
    "DEFAULT_PORT",
    "DEFAULT_PULSAR_PORT",
    "DEFAULT_PULSAR_TLS_PORT",
    "OPTIONS",
    "SPARK_OPTIONS",
    "Option",
    "parse_options",
    "parse_size",
    "topic_from_path",
]

DEFAULT_PORT = 6651
#: where ``broker start`` serves Pulsar's binary protocol (Pulsar's own default port)
DEFAULT_PULSAR_PORT = 6650
#: pulsar+ssl (with --tls-cert): Pulsar's own 6651 is tierstream's Flight port
DEFAULT_PULSAR_TLS_PORT = 6652
#: Pulsar's admin REST subset (Pulsar's webServicePort; webServicePortTls with --tls-cert)
DEFAULT_ADMIN_PORT = 8080
DEFAULT_ADMIN_TLS_PORT = 8443
DEFAULT_BROKER_URL = f"grpc://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_DATA_DIR = "./tierstream-data"


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _positive_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected a positive integer")
    value = int(str(raw).strip()) if not isinstance(raw, int) else raw
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _non_negative_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer >= 0")
    value = int(str(raw).strip()) if not isinstance(raw, int) else raw
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def _txn_name(raw: Any) -> str:
    return check_txn_id(str(raw).strip())


def parse_size(raw: Any, *, what: str = "size") -> int:
    """Bytes from ``1048576``, ``64KiB``, ``128MiB``...; ConfigError naming ``what``."""
    try:
        return _size_bytes(raw)
    except (ValueError, TypeError):
        raise ConfigError(f"invalid {what} {raw!r}: expected a positive size such as "
                          "1048576, 64KiB or 128MiB") from None


def _string_list(raw: Any) -> tuple[str, ...]:
    items = tuple(x.strip() for x in (raw.split(",") if isinstance(raw, str) else raw))
    if not items or not all(items):
        raise ValueError("expected a non-empty comma-separated list")
    return items


def _time(raw: Any) -> int:
    from tierstream.util.timeutil import parse_time_ms

    return parse_time_ms(raw)


def _duration(raw: Any) -> int:
    return parse_duration_ms(raw)


def _positive_duration(raw: Any) -> int:
    ms = parse_duration_ms(raw)
    if ms <= 0:
        raise ValueError("0 would end every one at once")
    return ms


def _string(raw: Any) -> str:
    text = str(raw)
    if not text:
        raise ValueError("expected a non-empty string")
    return text


def _format_duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _format_size(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass(frozen=True, kw_only=True)
class Option:
    """One option: its key, how to parse it, its default, and what it means."""

    key: str
    parse: Callable[[Any], Any]
    default: Any
    description: str
    kind: str  # what a valid value looks like, for error messages
    env: str | None = None
    secret: bool = False
    scopes: tuple[str, ...] = ("store",)
    #: Set by Spark itself (not by the user): accepted wherever Spark may pass it.
    spark_own: bool = False

    def help(self) -> str:
        """The description, with the default as a user writes it (for CLI flags)."""
        if self.default is None or self.secret:
            return self.description
        if self.parse is _duration:
            shown = _format_duration(self.default)
        elif self.parse is _size_bytes:
            shown = _format_size(self.default)
        elif isinstance(self.default, bool):
            shown = "true" if self.default else "false"
        else:
            shown = str(self.default)
        return f"{self.description} (default {shown})"

    def value_from(self, raw: Mapping[str, Any]) -> Any:
        if self.key in raw and raw[self.key] is not None:
            return self._parse(raw[self.key])
        if self.env and os.environ.get(self.env):
            return self._parse(os.environ[self.env], from_env=True)
        return self.default

    def _parse(self, value: Any, *, from_env: bool = False) -> Any:
        try:
            return self.parse(value)
        except (ValueError, TypeError, ConfigError) as exc:
            where = f"environment variable {self.env}" if from_env else f"option {self.key!r}"
            shown = "<hidden>" if self.secret else repr(value)
            raise ConfigError(f"invalid {where}: {shown} ({exc}); expected {self.kind}") from None


OPTIONS: dict[str, Option] = {
    o.key: o
    for o in [
        Option(key="dataDir", parse=_string, default=DEFAULT_DATA_DIR, env="TIERSTREAM_HOME",
               kind="a directory path", scopes=("store", "client", "read"),
               description="Directory of the embedded store (metadata.db, bookies/, tier/)."),
        Option(key="broker", parse=_string, default=DEFAULT_BROKER_URL, env="TIERSTREAM_BROKER",
               kind="a URL such as grpc://127.0.0.1:6651",
               scopes=("client", "read", "write"),
               description="Address of the broker's Arrow Flight endpoint."),
        Option(key="reconnectTimeout", parse=_duration, default=60_000,
               env="TIERSTREAM_RECONNECT_TIMEOUT", kind="a duration such as 30s or 5m",
               scopes=("client", "read"),
               description="How long a following read (tail, consume --follow, a stream) "
                           "retries an unavailable broker before it fails."),
        Option(key="tlsCa", parse=_string, default=None, env="TIERSTREAM_TLS_CA",
               kind="a PEM file path (or PEM text)", scopes=("client", "read", "write"),
               description="CA certificate that grpc+tls:// endpoints (broker, bookies) are "
                           "checked against; default: the system's CAs."),
        Option(key="authToken", parse=_string, default=None, env="TIERSTREAM_AUTH_TOKEN",
               secret=True, kind="a non-empty token",
               scopes=("store", "client", "read", "write"),
               description="Bearer token; required by a broker bound to a non-loopback address."),
        Option(key="bookies", parse=_positive_int, default=1, kind="an integer >= 1",
               description="Number of bookies (storage directories) of the embedded store."),
        Option(key="writeQuorum", parse=_positive_int, default=None, kind="an integer >= 1",
               description="Bookies each entry is written to (the ensemble; default: all)."),
        Option(key="ackQuorum", parse=_positive_int, default=None, kind="an integer >= 1",
               description="Bookies that must have fsync'd an entry before it is acknowledged "
                           "(default: a majority of the write quorum)."),
        Option(key="maxEntriesPerSegment", parse=_positive_int, default=50_000,
               kind="an integer >= 1",
               description="Roll the open segment after this many entries."),
        Option(key="maxSegmentBytes", parse=_size_bytes, default=256 * 1024**2,
               kind="a size such as 128MiB",
               description="Roll the open segment once its entries reach this many bytes."),
        Option(key="segmentRolloverTime", parse=_duration, default=4 * 3_600_000,
               kind="a duration such as 30s, 15m, 4h",
               description="Roll a non-empty open segment once it is this old."),
        Option(key="maxPublishTimeAhead", parse=_duration, default=3_600_000,
               kind="a duration such as 30s, 15m, 1h",
               description="Refuse a message whose requested publish time is further ahead of "
                           "the broker's clock (it would stamp every later message of its "
                           "partition, as publish time never runs backwards)."),
        Option(key="maxPartitionsPerTopic", parse=_positive_int, default=1024,
               kind="an integer >= 1",
               description="The most partitions a topic may have; larger requests are refused "
                           "before anything is registered."),
        Option(key="maxOpenLedgers", parse=_positive_int, default=512, kind="an integer >= 1",
               description="Per bookie: how many ledgers hold open files at a time for "
                           "appends (least recently written ones close theirs and reopen on "
                           "demand), and as many for reads (one file shared by every read "
                           "of it; the least recently read that no read uses close)."),
        Option(key="fsync", parse=_bool, default=True, kind="true or false",
               description="fsync bookie writes before acknowledging (turn off only for tests)."),
        Option(key="tierUrl", parse=_string, default=None, env="TIERSTREAM_TIER_URL",
               kind="a URL such as file:///data/tier or s3://bucket/prefix",
               description="Where offloaded segments go (default: tier/ in the data directory)."),
        Option(key="s3Endpoint", parse=_string, default=None, env="TIERSTREAM_S3_ENDPOINT",
               kind="a URL such as http://127.0.0.1:9000", scopes=("store", "read"),
               description="S3 endpoint for s3:// tiers (MinIO, moto); default: AWS."),
        Option(key="s3Region", parse=_string, default=None, env="AWS_REGION",
               kind="an AWS region such as us-east-1", scopes=("store", "read"),
               description="Region of the S3 bucket."),
        Option(key="catalogUri", parse=_string, default=None, env="TIERSTREAM_CATALOG_URI",
               kind="an SQLAlchemy URL such as sqlite:////data/catalog.db",
               description="Iceberg SQL catalog (default: catalog.db in the data directory)."),
        Option(key="tierLayout", parse=_string, default="key-buckets",
               kind="key-buckets or log",
               description="Row layout of tier files (key-buckets: fast key-range reads)."),
        Option(key="offloadAfter", parse=_duration, default=None,
               kind="a duration such as 1h or 7d",
               description="Offload closed segments whose newest message is older than this."),
        Option(key="offloadThreshold", parse=_size_bytes, default=None,
               kind="a size such as 1GiB",
               description="Offload the oldest closed segments of a topic while its "
                           "not-yet-offloaded bytes exceed this."),
        Option(key="deletionLag", parse=_duration, default=10 * 60_000,
               kind="a duration such as 0s, 10m or 4h",
               description="How long bookie copies stay after a segment moved to the tier, "
                           "and a compaction snapshot after a newer one replaced it (for "
                           "reads still on it)."),
        Option(key="tierCheckInterval", parse=_duration, default=30_000,
               kind="a duration such as 500ms or 30s",
               description="How often the broker applies offload, deletion and retention."),
        Option(key="autoScaleRate", parse=_positive_int, default=None,
               kind="messages per second, an integer >= 1",
               description="Grow a topic (double its partitions, at a scale event) when every "
                           "one of its partitions stays above this rate for autoScaleWindow; "
                           "off by default."),
        Option(key="autoScaleWindow", parse=_duration, default=60_000,
               kind="a duration such as 30s or 5m",
               description="How long every partition must stay above autoScaleRate."),
        Option(key="clientRefreshWait", parse=_duration, default=90_000,
               kind="a duration such as 90s or 5m",
               description="A topic whose keys its Pulsar clients route grows in two steps: "
                           "its clients see the new partitions at once, tierstream's readers "
                           "this long after, when every client has looked again and no key "
                           "is routed by the old count (Pulsar clients look every 60s)."),
        Option(key="transactionTimeout", parse=_positive_duration, default=15 * 60_000,
               kind="a duration above 0 such as 30s or 15m",
               description="A transaction neither committed nor written to for this long is "
                           "aborted and its staged data removed."),
        Option(key="transactionHoldLimit", parse=_positive_duration, default=30_000,
               kind="a duration above 0 such as 5s or 1m",
               description="A partition's messages after an undecided transaction's staged "
                           "entries are readable once it is decided (Pulsar's max read "
                           "position); when one has waited this long, the transaction's "
                           "entries there are set aside, to be written again at its commit, "
                           "and the rest becomes readable."),
        # -- what to read (the Spark adapter and the Python API) --------------------------
        Option(key="topic", parse=_string, default=None, kind="tenant/namespace/topic",
               scopes=("read", "write"),
               description="The topic to read; for the sink, the topic to write (else each "
                           "row's 'topic' column)."),
        Option(key="topics", parse=_string_list, default=None,
               kind="comma-separated tenant/namespace/topic names", scopes=("read",),
               description="Several topics to read."),
        Option(key="namespace", parse=_string, default=None, kind="tenant/namespace",
               scopes=("read",), description="Read every topic of a namespace."),
        Option(key="startingTime", parse=_time, default=None,
               kind="ISO-8601 or epoch milliseconds", scopes=("read",),
               description="Read messages published at or after this time."),
        Option(key="endingTime", parse=_time, default=None,
               kind="ISO-8601 or epoch milliseconds", scopes=("read",),
               description="Read messages published before this time (exclusive)."),
        Option(key="startingPosition", parse=_string, default=None,
               kind="earliest, latest or a stream cut as JSON", scopes=("read",),
               description="Where to start (default earliest)."),
        Option(key="endingPosition", parse=_string, default=None,
               kind="latest or a stream cut as JSON", scopes=("read",),
               description="Where to end, exclusive (default latest, resolved at planning)."),
        Option(key="keyRanges", parse=_positive_int, default=1, kind="an integer 1..65536",
               scopes=("read",), description="Split every partition into this many key ranges."),
        Option(key="maxSplitBytes", parse=_size_bytes, default=128 * 1024**2,
               kind="a size such as 64MiB", scopes=("read",),
               description="Target bytes one split reads."),
        Option(key="reader", parse=_string, default=None,
               kind="parquet-tier, bookie-log or tail-consumer", scopes=("read",),
               description="Force one reader (tests, benchmarks)."),
        Option(key="failOnDataLoss", parse=_bool, default=True, kind="true or false",
               scopes=("read",), description="Fail when data asked for was deleted."),
        Option(key="maxRecordsPerTrigger", parse=_positive_int, default=None,
               kind="an integer >= 1", scopes=("read",),
               description="Streaming: at most this many messages per micro-batch."),
        Option(key="maxBytesPerTrigger", parse=_size_bytes, default=None,
               kind="a size such as 64MiB", scopes=("read",),
               description="Streaming: about this many bytes per micro-batch (converted to "
                           "messages with the topic's average message size)."),
        Option(key="minRecordsPerTrigger", parse=_positive_int, default=None,
               kind="an integer >= 1", scopes=("read",),
               description="Streaming: wait for at least this many new messages before a "
                           "micro-batch, up to maxTriggerDelay (as Spark's Kafka source)."),
        Option(key="maxTriggerDelay", parse=_duration, default=15 * 60_000,
               kind="a duration such as 30s or 15m", scopes=("read",),
               description="Streaming: run a micro-batch after this long even below "
                           "minRecordsPerTrigger."),
        Option(key="subscription", parse=_string, default=None,
               kind="a subscription name", scopes=("read",),
               description="Streaming: the durable cursor a committed micro-batch advances "
                           "(default: one per query, derived from what it reads; tierstream "
                           "tail derives it from the checkpoint)."),
        Option(key="partitioning", parse=_string, default=None,
               kind="splits or key-ranges", scopes=("read",),
               description="Spark partitions: splits packed up to maxSplitBytes, each counted "
                           "4 MiB more for opening it, into at least minPartitions (splits: "
                           "most parallel; batch default), or one per topic partition and key "
                           "range reading its segments in log order (key-ranges: each key in "
                           "one Spark partition, in order; streaming default)."),
        Option(key="compacted", parse=_bool, default=False, kind="true or false",
               scopes=("read",),
               description="Batch: the latest message of each key (per partition), from the "
                           "topic's compaction snapshots and the log after them; a message "
                           "with an empty value removes its key, one without a key is left "
                           "out. One Spark partition per key range (keyRanges), each folding "
                           "its own keys: no shuffle. Streaming: the first micro-batch is that "
                           "state (whatever the read limit), later ones the log after it."),
        Option(key="cursorLabel", parse=_string, default=None,
               kind="text", scopes=("read",),
               description="Streaming: what tierstream subscriptions says of this query's "
                           "cursor (default 'a Spark stream'; tierstream tail gives its "
                           "checkpoint)."),
        Option(key="minPartitions", parse=_positive_int, default=None,
               kind="an integer >= 1", scopes=("read",),
               description="partitioning=splits: pack small splits into no fewer Spark "
                           "partitions than this (default: the session's default parallelism "
                           "for tierstream's jobs, else the planning host's cores)."),
        Option(key="tierReader", parse=_string, default="auto", kind="auto, native or source",
               scopes=("read",),
               description="Batch reads through tierstream.spark_adapter.read: tier splits on "
                           "Spark's Parquet reader (native), through the tierstream source "
                           "(source), or native where Spark can read the files (auto)."),
        Option(key="valueFormat", parse=_string, default="raw", kind="raw or auto",
               scopes=("read",),
               description="raw: values as bytes; auto: each value decoded by the schema "
                           "version it was written with into the topic's latest schema (a "
                           "struct column; one topic per read)."),
        Option(key="mode", parse=_string, default="FAILFAST",
               kind="FAILFAST, PERMISSIVE or DROPMALFORMED", scopes=("read",),
               description="valueFormat=auto: a value that cannot be decoded fails the read "
                           "(FAILFAST), becomes null with its bytes in _corrupt_record "
                           "(PERMISSIVE), or is skipped and counted (DROPMALFORMED)."),
        Option(key="tierCacheDir", parse=_string, default=None, kind="a directory path",
               scopes=("read",),
               description="This host's cache of tier bytes read from object storage, shared "
                           "by its readers (default: TIERSTREAM_TIER_CACHE_DIR, else "
                           "~/.cache/tierstream/tier; see tierstream cache)."),
        Option(key="tierCacheSize", parse=cache_bytes, default=None,
               kind="0 (off) or a size such as 2GiB", scopes=("read",),
               description="The most bytes the tier cache holds; 0 turns it off (default: "
                           "TIERSTREAM_TIER_CACHE_SIZE, else a tenth of the free disk where "
                           "it lives, at most 20GiB)."),
        Option(key="splits", parse=_string, default=None,
               kind="a JSON list of splits", scopes=("read",),
               description="Read exactly these splits instead of planning (what "
                           "tierstream.spark_adapter.read hands the source)."),
        # -- the sink (spark_adapter/sink.py) ---------------------------------------------
        Option(key="sinkId", parse=_txn_name, default=None,
               kind="1-64 characters of A-Z a-z 0-9 _ . -", scopes=("write",),
               description="Who commits: a commit of a batch id at or below this sink's last "
                           "committed one is a no-op (default: the streaming query's id from "
                           "its checkpoint; a batch write: its own)."),
        Option(key="batchId", parse=_non_negative_int, default=None,
               kind="an integer >= 0", scopes=("write",),
               description="Batch writes with sinkId: the batch this write is (re-running it "
                           "writes nothing twice)."),
        # -- what Spark itself hands a data source: accepted, never refused as unknown -----
        Option(key="path", parse=_string, default=None, kind="tenant/namespace/topic",
               scopes=("read", "write"), spark_own=True,
               description="Spark's load(path), save(path) or start(path): the topic, when "
                           "option 'topic' is not given."),
        Option(key="queryName", parse=_string, default=None, kind="a query name",
               scopes=("read", "write"), spark_own=True,
               description="Spark's writeStream.queryName(...) (passed through; not used)."),
        Option(key="checkpointLocation", parse=_string, default=None, kind="a directory",
               scopes=("read", "write"), spark_own=True,
               description="Spark's own option for streams (passed through; not used)."),
    ]
}

#: The options Spark sets on its own (``.queryName()``, ``.option("checkpointLocation")``,
#: ``load/save/start(path)``): every read and write accepts them.
SPARK_OPTIONS = tuple(k for k, o in OPTIONS.items() if o.spark_own)


def topic_from_path(opts: Mapping[str, Any]) -> str | None:
    """The topic named by option ``topic`` or, failing that, by Spark's ``path``
    (``load("acme/web/clicks")``). Raises ConfigError when both name different topics."""
    topic, path = opts.get("topic"), opts.get("path")
    if path is not None and topic is not None and path != topic:
        raise ConfigError(f"option 'topic' ({topic!r}) and the path ({path!r}) name different "
                          "topics; give one of them")
    return topic if topic is not None else path


def parse_options(raw: Mapping[str, Any], *, scope: str) -> dict[str, Any]:
    """Every option of ``scope``, parsed from ``raw`` (then env, then default).

    Raises :class:`ConfigError` for a key no option of ``scope`` has, suggesting the nearest.
    """
    known = {k: o for k, o in OPTIONS.items() if scope in o.scopes}
    by_lower = {k.lower(): k for k in known}
    # Spark hands options over case-insensitively (often lower-cased): map back to the key
    raw = {by_lower.get(k.lower(), k): v for k, v in raw.items()}
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"unknown option {key!r}{hint} valid options: {', '.join(sorted(known))}"
            )
    return {k: o.value_from(raw) for k, o in known.items()}
