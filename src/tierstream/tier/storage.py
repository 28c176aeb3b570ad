"""The tier: object storage holding offloaded segments as Parquet files, chosen by URL scheme.

``file://`` (the default, under the data directory) and ``s3://`` (s3fs/boto3, with an optional
endpoint so MinIO and moto work as well as AWS; credentials come from the usual AWS sources).

**Row layout.** A segment's rows are grouped into 16 key buckets of 4096 Key_Shared slots
each (bucket = key_hash // 4096), each bucket in log order and cut into row groups of about an
eighth of the bucket. Row-group statistics (min/max of publish_time and key_hash) let a reader
skip what it does not need:

- a key-range read of 1/k of the slots (k a power of two up to 16) reads exactly its buckets;
  for other k at most one extra bucket per range boundary;
- a time-window read reads, per bucket, the row groups overlapping the window.

Within a bucket rows keep log order, so each key's messages stay in order. The alternative
measured against it is plain log order (``layout="log"``), which is best for time windows but
makes every key-range read fetch the whole file (``python -m bench tier``).
"""

from __future__ import annotations

import os
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tierstream.errors import AuthError, ConfigError, NotFoundError, UnavailableError
from tierstream.model.message_format import KEY_HASH_SLOTS, MESSAGE_SCHEMA
from tierstream.model.names import TopicName
from tierstream.tier.cache import ObjectRef
from tierstream.tier.cached_file import CachedFile
from tierstream.tier.host_cache import host_cache

__all__ = ["KEY_BUCKETS", "TierStorage", "arrange"]

KEY_BUCKETS = 16
_BUCKET_SLOTS = KEY_HASH_SLOTS // KEY_BUCKETS
_ROW_GROUPS_PER_BUCKET = 8
_MIN_ROW_GROUP = 1024
LAYOUTS = ("key-buckets", "log")
#: S3 clients of this process, by kind, store and credentials: see _shared()
_S3: dict[tuple[Any, ...], Any] = {}
_S3_LOCK = threading.Lock()
_CREDENTIALS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "AWS_PROFILE", "AWS_REGION")


def _shared(store: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """One S3 client per kind and store (``store``) in this process, made by ``make`` and
    shared by its threads; a new one when the credentials in the environment change (or
    after a fork)."""
    key = (os.getpid(), *store, tuple(os.environ.get(k) for k in _CREDENTIALS_ENV))
    with _S3_LOCK:
        client = _S3.get(key)
        if client is None:
            client = _S3[key] = make()
        return client


def arrange(table: pa.Table, layout: str = "key-buckets") -> Iterator[tuple[pa.Table, int]]:
    """A segment's rows (given in log order) arranged for ``layout``: runs of rows, each
    written as row groups of the size given with it (the last one of a run may be smaller).
    One write per run, not per row group: ~0.6 ms less per row group. Runs are made as they
    are asked for, so the next one can be made while one is written."""
    if layout == "log":
        size = max(_MIN_ROW_GROUP, -(-table.num_rows // (KEY_BUCKETS * _ROW_GROUPS_PER_BUCKET)))
        yield table, size
        return
    if layout != "key-buckets":
        raise ConfigError(f"invalid tier layout {layout!r}: expected one of {LAYOUTS}")
    # one chunk per column first: a take over a column of ~100 chunks (one per entry read)
    # gathers a chunk at a time, ~10x slower for the value column than over one chunk
    # (505,000 rows: 0.22 s against 0.02 s, python -m bench offload --full)
    table = table.combine_chunks()
    hashes = table.column("key_hash").to_numpy()
    bucket = (hashes // _BUCKET_SLOTS).astype(np.int8)
    # A stable sort by bucket keeps log order within each bucket (numpy's is a radix sort
    # for 8-bit keys: ~20x faster than sorting on (bucket, row number) in Arrow).
    order = np.argsort(bucket, kind="stable")
    offset = 0
    for n in (int(c) for c in np.bincount(bucket, minlength=KEY_BUCKETS)):
        if n:
            yield (table.take(pa.array(order[offset:offset + n])),
                   max(_MIN_ROW_GROUP, -(-n // _ROW_GROUPS_PER_BUCKET)))
        offset += n


@dataclass(frozen=True, kw_only=True)
class TierStorage:
    """Where offloaded segments live. ``url`` is ``file:///abs/path`` or ``s3://bucket/prefix``."""

    url: str
    s3_endpoint: str | None = None
    s3_region: str | None = None
    layout: str = "key-buckets"

    def __post_init__(self) -> None:
        scheme = urlparse(self.url).scheme
        if scheme not in ("file", "s3"):
            raise ConfigError(f"invalid tier URL {self.url!r}: expected file:///path or "
                              "s3://bucket/prefix")
        if scheme == "s3" and not urlparse(self.url).netloc:
            raise ConfigError(f"invalid tier URL {self.url!r}: no bucket")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"invalid tier layout {self.layout!r}: expected one of {LAYOUTS}")

    @classmethod
    def from_location(cls, location: str, **kwargs: Any) -> TierStorage:
        """Accept a plain path as well as a URL."""
        if "://" not in location:
            location = Path(location).resolve().as_uri()
        return cls(url=location.rstrip("/"), **kwargs)

    @property
    def scheme(self) -> str:
        return urlparse(self.url).scheme

    # -- filesystems ------------------------------------------------------------------------

    def filesystem(self) -> Any:
        """The fsspec filesystem for this URL (s3fs imported only when needed)."""
        if self.scheme == "file":
            import fsspec

            return fsspec.filesystem("file")
        try:
            import s3fs
        except ImportError:  # pragma: no cover - s3fs is a dependency
            raise ConfigError("s3:// tier URLs need s3fs: pip install s3fs") from None
        # One per store and credentials in a process, shared by its threads: a new one makes
        # a new S3 client on its first request, 130-450 ms (python -m bench tier-cache: a
        # read of 16 files, one filesystem each, spent more on that than on its GETs)
        def make() -> Any:
            client_kwargs: dict[str, Any] = {}
            if self.s3_endpoint:
                client_kwargs["endpoint_url"] = self.s3_endpoint
            if self.s3_region:
                client_kwargs["region_name"] = self.s3_region
            # Bounded retries: an unreachable endpoint should fail in seconds, not minutes.
            # No listings cache: a long-lived instance must see what others wrote.
            return s3fs.S3FileSystem(
                client_kwargs=client_kwargs, skip_instance_cache=True, use_listings_cache=False,
                config_kwargs={"connect_timeout": 5, "read_timeout": 60,
                               "retries": {"max_attempts": 3}, "max_pool_connections": 32})

        return _shared(("s3fs", self.s3_endpoint, self.s3_region), make)

    def range_filesystem(self) -> Any:
        """What the tier cache fetches ranges of objects with: for S3, pyarrow's own client
        (C++, ranged GETs outside the GIL: 0.35 s of CPU per 268 MB against ~1.4 s through
        s3fs, which on two cores capped a first read through S3 at 0.2 of local files);
        else the fsspec filesystem."""
        if self.scheme != "s3":
            return self.filesystem()
        region = self.s3_region or os.environ.get("AWS_REGION") or \
            os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return _shared(("arrow", self.s3_endpoint, region),
                       lambda: _ArrowRanges(self.s3_endpoint, region))

    def path(self, url: str) -> str:
        parsed = urlparse(url)
        return parsed.path if parsed.scheme == "file" else f"{parsed.netloc}{parsed.path}"

    def iceberg_properties(self) -> dict[str, str]:
        """FileIO properties pyiceberg needs to read our files."""
        props: dict[str, str] = {}
        if self.scheme == "s3":
            if self.s3_endpoint:
                props["s3.endpoint"] = self.s3_endpoint
            region = self.s3_region or os.environ.get("AWS_REGION") or \
                os.environ.get("AWS_DEFAULT_REGION")
            if region:
                props["s3.region"] = region
            for env, key in (("AWS_ACCESS_KEY_ID", "s3.access-key-id"),
                             ("AWS_SECRET_ACCESS_KEY", "s3.secret-access-key"),
                             ("AWS_SESSION_TOKEN", "s3.session-token")):
                if os.environ.get(env):
                    props[key] = os.environ[env]
        return props

    # -- layout of paths --------------------------------------------------------------------

    def segment_url(self, topic: TopicName, partition: int, segment_id: int) -> str:
        """A fresh URL ``<tier>/<tenant>/<ns>/<topic>/partition=<p>/<id>-<uuid>.parquet``."""
        return posixpath.join(self.url, *topic.path_parts, f"partition={partition}",
                              f"{segment_id}-{uuid.uuid4().hex}.parquet")

    def topic_url(self, topic: TopicName) -> str:
        """``<tier>/<tenant>/<ns>/<topic>``: where every tier file of ``topic`` lives."""
        return posixpath.join(self.url, *topic.path_parts)

    def warehouse_url(self) -> str:
        return posixpath.join(self.url, "_iceberg")

    # -- I/O --------------------------------------------------------------------------------

    def check(self) -> None:
        """Fail with a clear error if the tier cannot be written (bad bucket, credentials)."""
        fs = self.filesystem()
        with _errors(self.url):
            if self.scheme == "file":
                Path(self.path(self.url)).mkdir(parents=True, exist_ok=True)
                return
            # ls, not exists: s3fs.exists answers False when the endpoint is unreachable
            fs.ls(urlparse(self.url).netloc, refresh=True)

    def write_segment(self, url: str, rows: pa.Table) -> int:
        """Write a segment's rows (in log order) to ``url``; returns the file's size in bytes.

        The file appears whole or not at all: a local file is written aside and renamed; an S3
        object is only visible once its upload completes.
        """
        runs = arrange(rows.cast(MESSAGE_SCHEMA), self.layout)
        fs = self.filesystem()
        path = self.path(url)
        target = path + ".tmp" if self.scheme == "file" else path
        with _errors(url), ThreadPoolExecutor(1, thread_name_prefix="tierstream-arrange") as ahead:
            if self.scheme == "file":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            with fs.open(target, "wb") as f:
                with pq.ParquetWriter(f, MESSAGE_SCHEMA, compression="zstd",
                                      write_statistics=True, use_dictionary=["key"]) as writer:
                    # the next run is gathered (a take: Arrow, without the GIL) while this
                    # one is encoded: on 2 cores the arranging costs no time
                    upcoming = ahead.submit(next, runs, None)
                    while (run := upcoming.result()) is not None:
                        upcoming = ahead.submit(next, runs, None)
                        writer.write_table(run[0], row_group_size=run[1])
                size = f.tell()  # the whole file: no size lookup (on S3 a HEAD)
            if self.scheme == "file":
                os.replace(target, path)
            return int(size)

    def size(self, url: str) -> int:
        with _errors(url):
            return int(self.filesystem().size(self.path(url)))

    def exists(self, url: str) -> bool:
        with _errors(url):
            return bool(self.filesystem().exists(self.path(url)))

    def read_segment(self, url: str, *, filters: Any = None, size: int | None = None,
                     columns: list[str] | None = None) -> pa.Table:
        """All rows of a tier file (optionally filtered by row groups' statistics), or only
        ``columns`` of them (a local file: only their bytes are read; a remote one is fetched
        whole through this host's tier cache, and only they are decoded). ``size``, when known,
        spares asking the store."""
        fs = self.filesystem()
        with _errors(url):
            cache = host_cache() if self.scheme != "file" else None
            if cache is None:
                return pq.read_table(self.path(url), filesystem=fs, filters=filters,
                                     columns=columns, schema=MESSAGE_SCHEMA)
            obj = ObjectRef(self.range_filesystem(), self.path(url),
                            size or int(fs.size(self.path(url))),
                            f"{self.scheme}:{self.s3_endpoint or ''}")
            # the whole object either way: the cache fetches a file that fits in one go (a
            # file-like object read column by column was slower and fetched no less)
            source = cache.open_whole(obj) or pa.py_buffer(CachedFile(cache, obj).read())
            return pq.read_table(source, filters=filters, columns=columns,
                                 schema=MESSAGE_SCHEMA)

    def delete_tree(self, url: str) -> None:
        """Delete everything under ``url`` (a directory or prefix), if anything is there."""
        fs = self.filesystem()
        with _errors(url):
            if fs.exists(self.path(url)):
                fs.rm(self.path(url), recursive=True)

    def delete(self, url: str) -> None:
        fs = self.filesystem()
        with _errors(url):
            if fs.exists(self.path(url)):
                fs.rm(self.path(url))

    def delete_topic(self, topic: TopicName) -> None:
        """Remove ``topic``'s folder (files left by interrupted offloads too) and, on a
        file tier, its tenant and namespace folders once they are empty (object stores
        have no empty folders)."""
        self.delete_tree(self.topic_url(topic))
        if self.scheme == "file":
            folder = Path(self.path(self.topic_url(topic))).parent
            root = Path(self.path(self.url))
            while folder != root and root in folder.parents:
                try:
                    folder.rmdir()  # only if empty: another topic's files stay
                except OSError:
                    break
                folder = folder.parent


class _ArrowRanges:
    """Ranged reads of S3 objects through pyarrow's S3 client: ``read_range`` (the tier
    cache's fetch) and ``protocol`` (what the reader asks of a filesystem)."""

    protocol = ("s3",)

    def __init__(self, endpoint: str | None, region: str) -> None:
        from pyarrow import fs as pafs

        kwargs: dict[str, Any] = {"region": region, "connect_timeout": 5,
                                  "request_timeout": 60}
        if endpoint:
            parsed = urlparse(endpoint)
            kwargs["endpoint_override"] = parsed.netloc or endpoint
            kwargs["scheme"] = parsed.scheme or "https"
        self._fs = pafs.S3FileSystem(**kwargs)
        #: open objects (opening one is a HEAD), most recent last; ReadAt is thread-safe
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()

    def read_range(self, path: str, start: int, end: int) -> memoryview:
        try:
            with self._lock:
                f = self._open.pop(path, None)
            if f is None:
                f = self._fs.open_input_file(path)
            with self._lock:
                self._open[path] = f
                while len(self._open) > 64:
                    self._open.pop(next(iter(self._open))).close()
            return memoryview(f.read_at(end - start, start))  # pyarrow's buffer, no copy
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) or "NoSuchKey" in str(exc) or \
                    "NO_SUCH_KEY" in str(exc) or "404" in str(exc):
                raise FileNotFoundError(path) from None
            raise


@contextmanager
def _errors(url: str) -> Iterator[None]:
    """Turn storage exceptions into tierstream errors that name the URL (never credentials)."""
    try:
        yield
    except (ConfigError, NotFoundError, UnavailableError, AuthError):
        raise
    except Exception as exc:
        name = type(exc).__name__
        text = str(exc)
        if name in ("NoCredentialsError", "PartialCredentialsError") or (
                "credentials" in text.lower() and "unable to locate" in text.lower()):
            raise AuthError(f"no credentials for tier {url!r}: set AWS_ACCESS_KEY_ID/"
                            "AWS_SECRET_ACCESS_KEY or an AWS profile") from None
        if isinstance(exc, PermissionError) or any(
                code in text for code in ("AccessDenied", "InvalidAccessKeyId",
                                          "SignatureDoesNotMatch")):
            raise AuthError(f"access to tier {url!r} denied: check the credentials") from None
        if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:
            raise NotFoundError(f"tier location {url!r} does not exist "
                                f"({_first_line(text)})") from None
        if isinstance(exc, OSError) or "EndpointConnectionError" in name or \
                "Could not connect" in text or "ConnectTimeout" in name:
            raise UnavailableError(f"tier {url!r} is unreachable: {_first_line(text)}") \
                from None
        raise


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "no detail"
