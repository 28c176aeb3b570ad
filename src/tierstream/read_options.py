"""What a read asks for, parsed once: the typed form of ``options.py``'s read options.

:class:`ReadOptions` is what the Spark adapter gets from ``spark.read.format("tierstream")``
options, what the Python API takes as ``options=`` (the same keys), and what the CLI builds
from its flags: one parse, one meaning of every option, wherever a read starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tierstream.enumerator import Enumerator, Query
from tierstream.errors import ConfigError
from tierstream.model import arguments
from tierstream.model.names import TopicName
from tierstream.options import parse_options, parse_size, topic_from_path
from tierstream.schemas.model import MODES

if TYPE_CHECKING:
    from tierstream.schemas.codec import Decoder

from tierstream.model.positions import Offset
from tierstream.splits.split import (
    BoundLike,
    Cuts,
    ReaderKind,
    Split,
    StreamCut,
    as_bound,
    cuts_from_dict,
    splits_from_json,
)
from tierstream.wire.security import read_pem

__all__ = ["BoundLike", "ReadOptions", "as_bound"]


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """A read: what (``topics`` or ``namespace``), between which bounds, how it is split, and
    where the store is. Build it with :meth:`parse` from option keys; picklable (it travels to
    Spark's workers); the token is kept out of its repr."""

    topics: tuple[str, ...]
    namespace: str | None
    start: Offset | StreamCut | Cuts
    end: Offset | StreamCut | Cuts
    key_ranges: int
    max_split_bytes: int
    reader: ReaderKind | None
    fail_on_data_loss: bool
    max_records_per_trigger: int | None
    max_bytes_per_trigger: int | None
    min_records_per_trigger: int | None
    max_trigger_delay_ms: int
    subscription: str
    data_dir: str
    broker: str
    auth_token: str | None = field(default=None, repr=False)
    s3_endpoint: str | None = None
    s3_region: str | None = None
    reconnect_timeout_ms: int = 60_000
    tls_ca: bytes | None = field(default=None, repr=False)  # PEM, read where the read started
    splits: tuple[Split, ...] | None = field(default=None, repr=False)  # planned already
    partitioning: str | None = None  # "splits" or "key-ranges"; None: the mode's default
    min_partitions: int | None = None  # partitioning=splits: pack into at least this many
    cursor_label: str | None = None  # streams: whose cursor, in `tierstream subscriptions`
    tier_reader: str = "auto"  # spark_adapter.read: "auto", "native" or "source"
    value_format: str = "raw"  # "raw" or "auto" (decode by the topic's schema)
    mode: str = "FAILFAST"  # valueFormat=auto: FAILFAST, PERMISSIVE or DROPMALFORMED
    partitions: tuple[int, ...] | None = None  # the Python API's partitions=: only these
    tier_cache_dir: str | None = None  # None: the host's (tier/host_cache.py)
    tier_cache_size: int | None = None  # None: the host's; 0: off
    compacted: bool = False  # Spark batch: the latest message per key (spark_adapter/compacted)

    @classmethod
    def from_kwargs(cls, topic: str | Sequence[str] | None = None, *,
                    namespace: str | None = None, start: BoundLike | None = None,
                    end: BoundLike | None = "latest", key_ranges: int = 1,
                    max_split_bytes: int = 128 * 1024**2, reader: ReaderKind | str | None = None,
                    fail_on_data_loss: bool = True, partitions: Sequence[int] | None = None,
                    data_dir: str | None = None, broker: str | None = None,
                    auth_token: str | None = None, value_format: str = "raw",
                    mode: str = "FAILFAST", tier_cache_dir: str | None = None,
                    tier_cache_size: int | str | None = None) -> ReadOptions:
        """The keyword arguments of ``tierstream.plan``/``scan``/``read``/``tail`` as a read:
        the store's options (and what the environment gives them) parsed once by
        :meth:`parse`, the typed arguments kept as they are."""
        if topic is not None and not isinstance(topic, str) and not (
                isinstance(topic, (list, tuple)) and all(isinstance(t, str) for t in topic)):
            raise ConfigError(f"invalid topic {topic!r}: expected a name tenant/namespace/topic "
                              "or a list of them")
        raw = {"topic": topic if isinstance(topic, str) else None,
               "topics": None if topic is None or isinstance(topic, str) else ",".join(topic),
               "namespace": namespace, "dataDir": data_dir, "broker": broker,
               "authToken": auth_token, "valueFormat": value_format, "mode": mode,
               "tierCacheDir": tier_cache_dir, "tierCacheSize": tier_cache_size}
        if raw["topic"] is None and raw["topics"] is None and namespace is None:
            raise ConfigError("a read needs a topic, topics or a namespace")
        parsed = cls.parse({k: v for k, v in raw.items() if v is not None})
        end_bound = as_bound(end, "end")
        if end_bound is None:
            raise ConfigError("end=None is an unbounded read: use tail() for that")
        return replace(parsed, start=as_bound(start, "start") or Offset.earliest(),
                       end=end_bound,
                       key_ranges=arguments.positive_int(key_ranges, "number of key ranges"),
                       max_split_bytes=parse_size(max_split_bytes, what="max_split_bytes"),
                       reader=None if reader is None or isinstance(reader, ReaderKind)
                       else ReaderKind.parse(reader),
                       fail_on_data_loss=arguments.flag(fail_on_data_loss, "fail_on_data_loss"),
                       partitions=_partitions(partitions))

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> ReadOptions:
        """Parse option keys (strings, as Spark passes them) through ``options.py``, once.
        Raises ConfigError naming the option and what would be valid."""
        opts = parse_options(dict(raw), scope="read")
        opts["topic"] = topic_from_path(opts)  # spark.read.format(...).load("a/b/c")
        given = [k for k in ("topic", "topics", "namespace") if opts[k] is not None]
        if len(given) != 1:
            raise ConfigError("option 'topic', 'topics' or 'namespace' is required (exactly "
                              f"one of them); got {given or 'none'}")
        topics = (opts["topic"],) if opts["topic"] else tuple(opts["topics"] or ())
        namespace = opts["namespace"]
        for topic in topics:
            TopicName.parse(topic)  # 'a/../b' fails here, before any path is built
        if namespace is not None:
            TopicName.parse(namespace + "/x")
        for side in ("starting", "ending"):
            if opts[f"{side}Time"] is not None and opts[f"{side}Position"] is not None:
                raise ConfigError(f"options '{side}Time' and '{side}Position' exclude each "
                                  "other")
        if opts["startingTime"] is not None and opts["endingTime"] is not None \
                and opts["endingTime"] < opts["startingTime"]:
            raise ConfigError(f"option 'endingTime' ({opts['endingTime']}) is before "
                              f"'startingTime' ({opts['startingTime']})")
        start = _bound(opts["startingPosition"], "startingPosition", opts["startingTime"],
                       default=Offset.earliest())
        end = _bound(opts["endingPosition"], "endingPosition", opts["endingTime"],
                     default=Offset.latest())
        for name, bound in (("startingPosition", start), ("endingPosition", end)):
            named = {bound.topic} if isinstance(bound, StreamCut) else \
                set(bound) if isinstance(bound, dict) else set()
            stray = sorted(named - set(topics)) if topics else []
            if stray:
                raise ConfigError(f"invalid option {name!r}: it has cuts of {stray}, which "
                                  f"are not read here ({', '.join(topics)})")
        if opts["partitioning"] not in (None, "splits", "key-ranges"):
            raise ConfigError(f"invalid option 'partitioning' {opts['partitioning']!r}: "
                              "expected splits or key-ranges")
        if opts["tierReader"] not in ("auto", "native", "source"):
            raise ConfigError(f"invalid option 'tierReader' {opts['tierReader']!r}: expected "
                              "auto, native or source")
        value_format = str(opts["valueFormat"]).strip().lower()
        if value_format not in ("raw", "auto"):
            raise ConfigError(f"invalid option 'valueFormat' {opts['valueFormat']!r}: expected "
                              "raw or auto")
        mode = str(opts["mode"]).strip().upper()
        if mode not in MODES:
            raise ConfigError(f"invalid option 'mode' {opts['mode']!r}: expected FAILFAST, "
                              "PERMISSIVE or DROPMALFORMED")
        if value_format == "auto" and len(topics) != 1:
            raise ConfigError("valueFormat=auto reads one topic (its schema gives the "
                              "columns); got " + (f"namespace {namespace!r}" if namespace
                                                  else f"{len(topics)} topics"))
        if opts["keyRanges"] > 65536:
            raise ConfigError(f"invalid option 'keyRanges': {opts['keyRanges']}; expected "
                              "1..65536")
        return cls(
            topics=topics, namespace=namespace, start=start, end=end,
            key_ranges=opts["keyRanges"], max_split_bytes=opts["maxSplitBytes"],
            reader=None if opts["reader"] is None else ReaderKind.parse(opts["reader"]),
            fail_on_data_loss=opts["failOnDataLoss"],
            max_records_per_trigger=opts["maxRecordsPerTrigger"],
            max_bytes_per_trigger=opts["maxBytesPerTrigger"],
            min_records_per_trigger=opts["minRecordsPerTrigger"],
            max_trigger_delay_ms=opts["maxTriggerDelay"],
            subscription=opts["subscription"] or _derived_subscription(opts),
            data_dir=opts["dataDir"], broker=opts["broker"], auth_token=opts["authToken"],
            s3_endpoint=opts["s3Endpoint"], s3_region=opts["s3Region"],
            reconnect_timeout_ms=opts["reconnectTimeout"],
            tls_ca=read_pem(opts["tlsCa"], "option 'tlsCa'"),
            splits=None if opts["splits"] is None else tuple(
                splits_from_json(opts["splits"], what="option 'splits'")),
            partitioning=opts["partitioning"], min_partitions=opts["minPartitions"],
            cursor_label=opts["cursorLabel"],
            tier_reader=opts["tierReader"],
            value_format=value_format, mode=mode,
            tier_cache_dir=opts["tierCacheDir"], tier_cache_size=opts["tierCacheSize"],
            compacted=opts["compacted"])

    @property
    def tier_cache(self) -> tuple[str | None, int | None]:
        """The read's own tier cache settings (directory, size), for ``open_reader``."""
        return self.tier_cache_dir, self.tier_cache_size

    def decoder(self) -> Decoder | None:
        """For valueFormat=auto, the decoder of the topic's schema versions (read now, on
        the driver); None for raw."""
        if self.value_format != "auto":
            return None
        from tierstream.schemas.codec import Decoder

        with self.enumerator() as enum:
            versions = enum.schema_versions(self.topics[0])
        if not versions:
            raise ConfigError(f"valueFormat=auto: topic {self.topics[0]!r} has no schema "
                              "(tierstream schema set); read it with valueFormat=raw")
        return Decoder(versions)

    def check_exists(self) -> None:
        """At ``load()``: the topics (or the namespace) exist. Raises NotFoundError."""
        with self.enumerator() as enum:
            enum.topics(Query(topics=self.topics, namespace=self.namespace))

    def enumerator(self) -> Enumerator:
        return Enumerator(data_dir=self.data_dir, broker=self.broker, auth_token=self.auth_token,
                          tls_ca=self.tls_ca,
                          s3_endpoint=self.s3_endpoint, s3_region=self.s3_region)

    def query(self) -> Query:
        """The enumerator's query of this read (one topic's cut, or none, as bounds; the
        per-topic cuts of a multi-topic stream are planned topic by topic by the adapter)."""
        if isinstance(self.start, dict) or isinstance(self.end, dict):
            raise ConfigError("cuts of several topics bound a Spark stream's read; plan each "
                              "topic with its own cut")
        return Query(topics=self.topics, namespace=self.namespace, start=self.start,
                     end=self.end, key_ranges=self.key_ranges,
                     max_split_bytes=self.max_split_bytes, reader=self.reader,
                     fail_on_data_loss=self.fail_on_data_loss, partitions=self.partitions)


def _partitions(value: object) -> tuple[int, ...] | None:
    """The Python API's ``partitions=``: partition numbers, or None for all."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, range)) \
            or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                       for p in value):
        raise ConfigError(f"invalid partitions {value!r}: expected a list of partition "
                          "numbers >= 0, or None for all")
    return tuple(value)


def _derived_subscription(opts: dict[str, Any]) -> str:
    """One cursor per query by default: a name derived from what the query reads, so a
    restarted query keeps its cursor and a different one does not overwrite it."""
    import hashlib

    what = json.dumps([opts["topic"], opts["topics"], opts["namespace"],
                       opts["startingPosition"], opts["startingTime"], opts["keyRanges"]],
                      sort_keys=True, default=str)
    return "spark-" + hashlib.sha256(what.encode()).hexdigest()[:12]


def _bound(position: str | None, name: str, time_ms: int | None, *, default: Offset
           ) -> Offset | StreamCut | Cuts:
    """A time, earliest/latest, a topic's stream cut, or cuts per topic (the offset of a
    multi-topic stream: ``{"v": 1, "cuts": {topic: cut}}``)."""
    if time_ms is not None:
        return Offset.at_time(time_ms)
    if position is None:
        return default
    text = position.strip()
    if text.lower() in ("earliest", "latest"):
        return Offset.parse(text)
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError(f"invalid option {name!r}: expected earliest, latest or a stream cut "
                          f"as JSON, got {text[:80]!r}") from None
    try:
        if isinstance(data, dict) and "cuts" in data:
            return cuts_from_dict(data)
        return StreamCut.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"invalid option {name!r}: {exc}") from None
