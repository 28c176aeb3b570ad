"""The parquet-tier reader: an offloaded segment from its Parquet file (pyarrow + fsspec).

It opens the footer, keeps only the row groups whose statistics (publish_time, key_hash,
entry_id) can hold rows of the split, and reads them in order, ``READ_AHEAD`` row groups per
read. On a remote store up to ``READ_AHEAD`` such reads are in flight at once, so request
latency overlaps decoding: memory is bounded by ``READ_AHEAD`` row groups locally and by
``READ_AHEAD ** 2`` remotely.

A remote file's size comes with the split (recorded at offload), so opening it costs no HEAD
request; a small one (``SMALL_FILE``) is fetched whole, in parallel ranged GETs, since each
request pays the store's latency and a small file's decoding cannot hide it. Local files are
opened by pyarrow itself, memory-mapped.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.spec import AbstractBufferedFile

from tierstream.errors import CorruptionError, DataLossError, NotFoundError, UnavailableError
from tierstream.model.message_format import with_topic
from tierstream.readers.stats import (
    BROKER_FALLBACK,
    LOCAL,
    OBJECT_STORE,
    TIER_CACHE,
    ReadStats,
    counted,
)
from tierstream.readers.trim import trim
from tierstream.splits.split import Split
from tierstream.tier.cache import ObjectRef, TierCache
from tierstream.tier.cached_file import CachedFile
from tierstream.tier.host_cache import host_cache
from tierstream.tier.storage import TierStorage

__all__ = ["READ_AHEAD", "leaf_column", "read_tier_split", "selected_row_groups"]

log = logging.getLogger(__name__)

READ_AHEAD = 8
#: Remote tier files up to this size are fetched whole (_fetch_whole), before decoding.
SMALL_FILE = 16 * 1024**2
#: The smallest ranged request a whole small file is fetched in.
MIN_RANGE = 256 * 1024
READER = "parquet-tier"
#: A read's own cache settings (directory, size), over the host's: see tier/host_cache.py
TierCacheSettings = tuple[str | None, int | None]
#: The host's cache and the object, when a remote file is read through the cache
Source = tuple[TierCache, ObjectRef] | None


def leaf_column(meta: pq.FileMetaData, name: str) -> int:
    """The Parquet leaf column index of a top-level primitive column. Not the Arrow field
    index: the ``properties`` map expands into two leaf columns."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path == name:
            return i
    raise CorruptionError(f"a tier file has no column {name!r}: it was not written by "
                          "tierstream (or was changed since)")


@dataclass(frozen=True)
class _Plan:
    """A row group to read and which of the split's bounds its rows might cross."""

    index: int
    positions: bool
    time: bool
    keys: bool


def _plans(meta: pq.FileMetaData, split: Split) -> list[_Plan]:
    kh, pt, en = (leaf_column(meta, c) for c in ("key_hash", "publish_time", "entry_id"))
    first_entry = split.start.entry_id
    last_entry = None if split.end is None else split.end.entry_id  # inclusive (batch_index)
    out = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        k, t, e = (rg.column(c).statistics for c in (kh, pt, en))
        k_ok = k is not None and k.has_min_max
        t_ok = t is not None and t.has_min_max
        e_ok = e is not None and e.has_min_max
        r = split.key_range
        if k_ok and not r.is_full and (k.max < r.lo or k.min >= r.hi):
            continue
        if t_ok and ((split.start_time is not None and t.max < split.start_time)
                     or (split.end_time is not None and t.min >= split.end_time)):
            continue
        if e_ok and (e.max < first_entry or (last_entry is not None and e.min > last_entry)):
            continue
        # which bounds can cut through this row group (the others need no per-row check)
        inside_start = e_ok and (e.min > first_entry or (
            e.min == first_entry and split.start.batch_index == 0))
        inside_end = split.end is None or (e_ok and last_entry is not None and e.max < last_entry)
        inside_time = t_ok and (split.start_time is None or t.min >= split.start_time) and (
            split.end_time is None or t.max < split.end_time)
        inside_keys = r.is_full or (k_ok and k.min >= r.lo and k.max < r.hi)
        out.append(_Plan(i, not (inside_start and inside_end), not inside_time,
                         not inside_keys))
    return out


def selected_row_groups(meta: pq.FileMetaData, split: Split) -> list[int]:
    """Row groups that may hold rows of ``split``, judged by their min/max statistics."""
    return [plan.index for plan in _plans(meta, split)]


def read_tier_split(split: Split, *, auth_token: str | None = None,
                    tls_ca: bytes | None = None, stats: ReadStats | None = None,
                    cache: TierCacheSettings | None = None) -> Iterator[pa.RecordBatch]:
    """The split's rows from its tier file. A ``file://`` tier that this host cannot see
    (its directory is not here: another machine) is read through the broker instead, which
    serves the segment from the tier; only a file missing where its directory is, is lost.
    A remote file is read through this host's tier cache (``cache`` overrides its settings)."""
    if split.tier_url is None:
        raise NotFoundError(f"split {split.split_id} has no tier URL")
    tier = TierStorage(url=split.tier_url, s3_endpoint=split.tier.s3_endpoint,
                       s3_region=split.tier.s3_region)
    fs = tier.filesystem()
    path = tier.path(split.tier_url)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    remote = "file" not in protocols  # an object store: every request pays latency
    handle = None
    size = split.tier_bytes
    in_memory = False
    source: Source = None  # how each read-ahead worker opens the file through the cache
    cached: CachedFile | None = None
    mapped: pa.MemoryMappedFile | None = None  # a local copy the cache holds whole
    whole_cached = False
    try:
        if not remote:  # pyarrow's own (memory-mapped) file: faster than an fsspec handle
            pf = pq.ParquetFile(path, memory_map=True)
        else:
            if not size:  # offloaded before sizes were recorded: ask the store (a HEAD)
                size = int(fs.size(path))
            in_memory = 0 < size <= SMALL_FILE
            host = host_cache(*(cache or (None, None)))
            if host is not None:
                obj = ObjectRef(tier.range_filesystem(), path, size,
                                f"{tier.scheme}:{split.tier.s3_endpoint or ''}")
                source = (host, obj)
                cached = CachedFile(host, obj)
                mapped = host.open_whole(obj)
                if mapped is not None:  # held whole: read as a local file is, mapped
                    pf = pq.ParquetFile(mapped)
                    in_memory = whole_cached = True
                elif in_memory:  # every block at once, missing ones as _fetch_whole's ranges
                    pf = pq.ParquetFile(pa.py_buffer(cached.read()))
                    whole_cached = cached.from_store == 0
                else:
                    pf = pq.ParquetFile(cached)
            elif in_memory:
                # a small remote file is fetched whole, not footer, then metadata, then
                # data: each request pays the store's latency, which a small file's
                # decoding cannot hide
                pf = pq.ParquetFile(pa.py_buffer(_fetch_whole(fs, path, size)))
            else:
                handle = _open(fs, path, size)
                pf = pq.ParquetFile(handle)
    except FileNotFoundError:
        if handle is not None:
            handle.close()
        if tier.scheme == "file" and not fs.exists(posixpath.dirname(path)):
            if split.broker is None:
                raise UnavailableError(
                    f"the tier file {split.tier_url} of {split.topic!r} partition "
                    f"{split.partition} is on another host: give the broker's address (option "
                    "'broker') to read it through the broker, or keep the tier on S3") from None
            log.info("tier file %s is not on this host; reading it through the broker %s",
                     split.tier_url, split.broker)
            from tierstream.readers.tail import read_tail_split

            yield from counted(read_tail_split(split, auth_token=auth_token, tls_ca=tls_ca),
                               stats, READER, BROKER_FALLBACK)
            return
        raise _gone(split) from None
    try:
        plans = _plans(pf.metadata, split)
        if source is not None and not in_memory:
            host, obj = source
            wanted = _blocks(pf.metadata, plans, host.block_size)
            if len(wanted) == -(-obj.size // host.block_size) and host.has_room(obj, wanted):
                # the whole file is read and fits: fetched at once, many GETs in flight,
                # then decoded from the local copy as a local file is
                host.fetch(obj, wanted)
                if (fetched := host.open_whole(obj, count=False)) is not None:
                    pf.close()
                    pf, mapped, in_memory = pq.ParquetFile(fetched), fetched, True
            if not in_memory:  # the planned row groups' blocks, in order, ahead of pyarrow
                host.prefetch(obj, wanted)
        # a few row groups per read: pyarrow decodes them in parallel
        chunks = [plans[i:i + READ_AHEAD] for i in range(0, len(plans), READ_AHEAD)]
        first_kind = LOCAL if not remote else TIER_CACHE if whole_cached else OBJECT_STORE
        ahead = remote and not in_memory
        for chunk, (table, path_kind) in zip(
                chunks, _read_chunks(fs, path, pf, chunks, ahead, size, first_kind, source,
                                     None if in_memory else cached),
                strict=True):
            out = trim(table, split, check_positions=any(p.positions for p in chunk),
                       check_time=any(p.time for p in chunk),
                       check_keys=any(p.keys for p in chunk))
            for batch in out.to_batches():
                if batch.num_rows:
                    if stats is not None:
                        stats.add(READER, path_kind, batch.num_rows, batch.nbytes)
                    yield with_topic(batch, split.topic)
    except FileNotFoundError:  # opened by its known size: a missing file shows on reading
        raise _gone(split) from None
    finally:
        pf.close()
        if handle is not None:
            handle.close()
        if mapped is not None:
            mapped.close()


def _blocks(meta: pq.FileMetaData, plans: list[_Plan], block_size: int) -> list[int]:
    """The cache blocks holding the planned row groups' column chunks, in file order."""
    out: set[int] = set()
    for plan in plans:
        rg = meta.row_group(plan.index)
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = col.dictionary_page_offset if col.has_dictionary_page else \
                col.data_page_offset
            end = start + col.total_compressed_size
            out.update(range(start // block_size, (end - 1) // block_size + 1))
    return sorted(out)


def _fetch_whole(fs: Any, path: str, size: int) -> bytes:
    """A remote file of known ``size`` in ranged GETs of at least ``MIN_RANGE`` bytes, up to
    ``READ_AHEAD`` at once: an object store's throughput is per request (connection), so
    a file arrives in about one latency plus its size over ``READ_AHEAD`` connections. Ranged,
    too, because without a range s3fs asks for the size first (a HEAD)."""
    step = max(MIN_RANGE, -(-size // READ_AHEAD))
    ranges = [(start, min(start + step, size)) for start in range(0, size, step)]
    if len(ranges) == 1:
        return bytes(fs.cat_file(path, start=0, end=size))
    with ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix="tier-fetch") as pool:
        parts = list(pool.map(lambda r: fs.cat_file(path, start=r[0], end=r[1]), ranges))
    return b"".join(parts)


def _open(fs: Any, path: str, size: int | None, **kwargs: Any) -> Any:
    """``path`` opened for reading; of a known ``size`` without asking the store for it (s3fs
    would send a HEAD first, for the size and again before the first ranged read)."""
    if not size:
        return fs.open(path, "rb", **kwargs)
    handle = fs.open(path, "rb", size=size, **kwargs)
    if isinstance(handle, AbstractBufferedFile):
        handle.details = {"name": path, "size": size, "type": "file"}
    return handle


def _gone(split: Split) -> DataLossError:
    return DataLossError(
        f"data loss in {split.topic!r} partition {split.partition}: the tier file of "
        f"segment {split.segment_id} ({split.tier_url}) is gone (deleted by retention "
        "after planning?)")


def _read_chunks(fs: Any, path: str, pf: pq.ParquetFile, chunks: list[list[_Plan]],
                 remote: bool, size: int | None, kind: str, source: Source,
                 main: CachedFile | None) -> Iterator[tuple[pa.Table, str]]:
    """Each chunk's rows and the path they took: ``kind``, unless read through the cache
    (``main``: the file ``pf`` reads, through the cache; ``source``: what each read-ahead
    worker opens)."""
    if not remote or len(chunks) <= 1:
        for chunk in chunks:
            yield _counted_read(pf, chunk, main, kind)
        return
    local = threading.local()
    opened: list[Any] = []  # every worker's file, closed when the read ends

    def load(chunk: list[_Plan]) -> tuple[pa.Table, str]:
        own = getattr(local, "pf", None)
        if own is None:  # one open file per worker thread: ParquetFile is not thread-safe
            # no read-ahead cache (s3fs's would fetch from each read to the end of its 50 MiB
            # block: every worker the rest of the file); pyarrow's pre-buffering instead
            # joins the column chunks of the row groups asked for into a few ranged reads
            handle = CachedFile(*source) if source else _open(fs, path, size, cache_type="none")
            opened.append(handle)
            local.handle = handle
            local.pf = own = pq.ParquetFile(handle, pre_buffer=True, metadata=pf.metadata)
        return _counted_read(own, chunk, local.handle if source else None, kind)

    # remote: up to READ_AHEAD chunks in flight, so request latency overlaps decoding
    try:
        with ThreadPoolExecutor(max_workers=READ_AHEAD,
                                thread_name_prefix="tier-read") as pool:
            pending: deque[Future[tuple[pa.Table, str]]] = deque()
            it = iter(chunks)
            for chunk in it:
                pending.append(pool.submit(load, chunk))
                if len(pending) >= READ_AHEAD:
                    break
            while pending:
                table = pending.popleft().result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(pool.submit(load, nxt))
                yield table
    finally:
        for handle in opened:
            handle.close()


def _counted_read(pf: pq.ParquetFile, chunk: list[_Plan], handle: CachedFile | None, kind: str
                  ) -> tuple[pa.Table, str]:
    """A chunk's row groups; read through the cache (``handle``), they took the cache's path
    when no byte of them came from the store."""
    before = handle.from_store if handle is not None else 0
    table = pf.read_row_groups([p.index for p in chunk])
    if handle is None:
        return table, kind
    return table, TIER_CACHE if handle.from_store == before else OBJECT_STORE
