"""The local runner: the same plan and readers as Spark, on a thread pool, without Spark.

``plan`` returns splits, ``scan`` yields their batches (READ_SCHEMA), ``read`` collects a
table, ``tail`` follows the log from a cut, a time or ``latest``. Every function takes the
store's data directory and broker address (defaults: the option table, i.e.
``TIERSTREAM_HOME`` / ``TIERSTREAM_BROKER``).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from tierstream.errors import ConfigError
from tierstream.model import arguments
from tierstream.model.message_format import READ_SCHEMA
from tierstream.model.positions import KeyRange, Offset, OffsetKind
from tierstream.read_options import BoundLike, ReadOptions, as_bound
from tierstream.readers import ReadStats, open_reader
from tierstream.runtime.compacted import compacted_batches
from tierstream.runtime.event_time import check_time_field, event_time_window, within_event_time
from tierstream.runtime.follow import follow
from tierstream.schemas.codec import decode_batches
from tierstream.splits.split import ReaderKind, Split, StreamCut, chains
from tierstream.util.fanin import DONE, Cancel, drain, put, start_reader

__all__ = ["Following", "latest_cut", "phases", "plan", "read", "run_splits", "scan", "tail"]

Chain = list[Split]  # read one after another
Phase = list[Chain]  # chains read in parallel


def plan(topic: str | Sequence[str] | None = None, *, namespace: str | None = None,
         start: BoundLike | None = None, end: BoundLike | None = "latest", key_ranges: int = 1,
         max_split_bytes: int = 128 * 1024**2, reader: ReaderKind | str | None = None,
         fail_on_data_loss: bool = True, partitions: Sequence[int] | None = None,
         data_dir: str | None = None, broker: str | None = None,
         auth_token: str | None = None,
         options: ReadOptions | Mapping[str, Any] | None = None) -> list[Split]:
    """The splits of a bounded read (driver side; reads metadata only).

    ``options`` takes the read as the Spark source's options (the same keys: ``topic``,
    ``startingTime``, ``keyRanges``, ``dataDir``...) or a parsed :class:`ReadOptions`, instead
    of the keyword arguments. Raises ConfigError for a bad query, NotFoundError for an unknown
    topic, DataLossError if the start lies in data deleted by retention (unless
    ``fail_on_data_loss=False``).
    """
    return _plan(_read_options(topic, options, namespace=namespace, start=start, end=end,
                               key_ranges=key_ranges, max_split_bytes=max_split_bytes,
                               reader=reader, fail_on_data_loss=fail_on_data_loss,
                               partitions=partitions, data_dir=data_dir, broker=broker,
                               auth_token=auth_token))


def _read_options(topic: str | Sequence[str] | None,
                  options: ReadOptions | Mapping[str, Any] | None, **kwargs: Any
                  ) -> ReadOptions:
    """The read a public entry was given, as one :class:`ReadOptions`: ``options`` (parsed
    here if they are option keys), else the keyword arguments."""
    if options is None:
        return ReadOptions.from_kwargs(topic, **kwargs)
    if topic is not None or kwargs.get("namespace") is not None:
        raise ConfigError("give the topic either in options or as an argument, not both")
    return options if isinstance(options, ReadOptions) else ReadOptions.parse(options)


def _plan(read: ReadOptions) -> list[Split]:
    with read.enumerator() as enum:
        return list(enum.plan(read.query()))


def run_splits(splits: Sequence[Split], *, parallelism: int | None = None,
               auth_token: str | None = None, cancel: Cancel | None = None,
               tls_ca: bytes | None = None, stats: ReadStats | None = None,
               tier_cache: tuple[str | None, int | None] | None = None
               ) -> Iterator[pa.RecordBatch]:
    """Read ``splits`` on a thread pool, keeping every key's order; ``stats`` counts rows
    and bytes per reader and path (local file, bookie endpoint, broker, tier cache...);
    ``tier_cache`` overrides the host's tier cache settings (directory, size).

    Splits of one (topic, partition, key range) are read one after another in log order;
    different ones run in parallel. Key ranges never share a key, so each key's messages come
    out in log order across the whole read; parallelism is partitions x key ranges. The key
    ranges of one bookie segment are read once, whole (see :func:`phases`). Memory is bounded
    by a small queue.
    """
    roots = phases(chains(list(splits)))
    total = sum(len(phase) for root in roots for phase in root)
    if not total:
        return
    width = sum(max(len(phase) for phase in root) for root in roots)
    workers = max(1, min(parallelism or 8, width))
    out: queue.Queue[Any] = queue.Queue(maxsize=4 * workers)
    pending: queue.SimpleQueue[tuple[int, int, Chain]] = queue.SimpleQueue()
    lock = threading.Lock()
    left = {(r, 0): len(root[0]) for r, root in enumerate(roots)}  # chains of a phase to go
    unstarted = [total]
    for r, root in enumerate(roots):
        for chain in root[0]:
            pending.put((r, 0, chain))
    # Set when the consumer leaves, or when ``cancel`` is (by its owner, from any thread):
    # interrupts tail reads waiting on the broker and ends the iteration.
    stop = Cancel()
    unlink = cancel.register(stop.set) if cancel is not None else None

    def work(chain: list[Split]) -> bool:
        try:
            for split in chain:
                for batch in open_reader(split, auth_token=auth_token, cancel=stop,
                                         tls_ca=tls_ca, stats=stats, tier_cache=tier_cache):
                    if not put(out, batch, stop):
                        return False
            return True
        except BaseException as exc:  # handed to the consuming thread
            if not stop.is_set():
                put(out, exc, stop)
            return False
        finally:
            put(out, DONE, stop)

    def finished(r: int, p: int) -> None:
        """A chain of phase ``p`` of root ``r`` ended well: the next phase starts when the
        last one does (each key's splits of the phase are then all delivered)."""
        with lock:
            left[(r, p)] -= 1
            if left[(r, p)] or p + 1 == len(roots[r]):
                return
            left[(r, p + 1)] = len(roots[r][p + 1])
        for chain in roots[r][p + 1]:
            pending.put((r, p + 1, chain))

    def worker() -> None:
        while not stop.is_set():
            with lock:
                if not unstarted[0]:
                    return
            try:
                r, p, chain = pending.get(timeout=0.05)
            except queue.Empty:
                continue  # a phase still running will queue the next one
            with lock:
                unstarted[0] -= 1
            if work(chain):
                finished(r, p)

    # Daemon threads: a following read blocked on the broker never holds up interpreter exit
    # (a ThreadPoolExecutor joins its threads at exit), and close() interrupts it at once.
    for i in range(workers):
        start_reader(worker, name=f"tierstream-read-{i}")
    try:
        yield from drain(out, total, stop)
    finally:
        stop.set()
        if unlink is not None:
            unlink()


def phases(groups: list[Chain]) -> list[list[Phase]]:
    """Chains (see :func:`~tierstream.splits.split.chains`) by root, each root as phases run
    one after another, a phase's chains in parallel.

    A key-range split of a segment on the bookies must read and verify every entry of it
    (the ledger is in log order, not by key), so k ranges read separately cost k whole reads.
    When the k chains of a root are aligned (the same segments with the same bounds, their
    ranges together every key), each run of bookie steps becomes one phase of a single chain
    that reads those segments whole: the same rows, each key in log order, read once. Steps
    of other readers stay k parallel chains (a tier file's key buckets make a range read
    cheap). Anything else is one phase of its chains, as planned."""
    roots: dict[tuple[str, int], list[Chain]] = {}
    for chain in groups:
        roots.setdefault((chain[0].topic, chain[0].root), []).append(chain)
    out: list[list[Phase]] = []
    for members in roots.values():
        steps = _aligned(members)
        if steps is None:
            out.append([members])
            continue
        root: list[Phase] = []
        whole_before: bool | None = None
        for step in steps:
            whole = step[0].reader is ReaderKind.BOOKIE
            if whole is not whole_before:
                root.append([[]] if whole else [[] for _ in step])
                whole_before = whole
            if whole:
                root[-1][0].append(replace(step[0].whole(), estimated_bytes=sum(
                    s.estimated_bytes for s in step)))
            else:
                for chain, split in zip(root[-1], step, strict=True):
                    chain.append(split)
        out.append(root)
    return out


def _aligned(members: list[Chain]) -> list[list[Split]] | None:
    """The steps (one split per chain, in order) of a root's chains when they differ only in
    their key ranges, and those ranges cover every key; else None."""
    if len(members) < 2 or len({len(c) for c in members}) != 1:
        return None
    if not KeyRange.tile([c[0].key_range for c in members]):
        return None
    steps = [list(step) for step in zip(*members, strict=True)]
    for step in steps:
        head = step[0].whole()
        if any(s.whole() != head for s in step[1:]):
            return None
    return steps


def scan(topic: str | Sequence[str] | None = None, *, parallelism: int | None = None,
         stats: ReadStats | None = None, value_format: str = "raw", mode: str = "FAILFAST",
         time_field: str = "publish_time", compacted: bool = False,
         **kwargs: Any) -> Iterator[pa.RecordBatch]:
    """Batches (READ_SCHEMA) of a bounded read; arguments as :func:`plan`. ``stats`` (a
    :class:`~tierstream.readers.stats.ReadStats`) counts which way each split was read.

    ``value_format="auto"`` decodes each value by the schema version it was written with into
    the topic's latest schema (``value`` becomes a struct, or text for STRING); ``mode`` says
    what happens to a value that cannot be decoded (FAILFAST, PERMISSIVE, DROPMALFORMED: see
    the option ``mode``).

    ``time_field="event_time"`` makes ``start``/``end`` (times) a window on event_time: the
    whole log up to its latest position is read and filtered (event times are not ordered;
    see ``tierstream/runtime/event_time.py``).

    ``compacted=True`` reads the latest message of each key (per partition): the topic's
    compaction snapshots, then the log after them (``tierstream/runtime/compacted.py``);
    a message with an empty value removes its key, one without a key is left out."""
    parallelism = arguments.positive_int(parallelism, "parallelism", none_ok=True)
    arguments.instance(stats, "stats", ReadStats, "a tierstream.readers.ReadStats, or None")
    if arguments.flag(compacted, "compacted"):
        check_time_field(time_field)
        if time_field != "publish_time":
            raise ConfigError("a compacted read takes no event-time window")
        decoder = _read_options(topic, None, value_format=value_format, mode=mode,
                                **{k: v for k, v in kwargs.items()
                                   if k in ("data_dir", "broker", "auth_token")}).decoder()
        folded = compacted_batches(topic, functools.partial(scan, parallelism=parallelism,
                                                            stats=stats), **kwargs)
        if decoder is None:
            yield from folded
        else:
            yield from decode_batches(folded, decoder, mode, str(topic))
        return
    window = None
    if check_time_field(time_field) == "event_time":
        if kwargs.get("options") is not None:
            raise ConfigError("time_field='event_time' takes start/end arguments, not options")
        window = event_time_window(as_bound(kwargs.pop("start", None), "start"),
                                   as_bound(kwargs.pop("end", "latest"), "end"), "start/end")
        kwargs["end"] = "latest"
        yield from within_event_time(scan(topic, parallelism=parallelism, stats=stats,
                                          value_format=value_format, mode=mode, **kwargs),
                                     *window)
        return
    options = kwargs.pop("options", None)
    read = _read_options(topic, options, value_format=value_format, mode=mode, **kwargs)
    decoder = read.decoder()
    batches = run_splits(_plan(read), parallelism=parallelism, auth_token=read.auth_token,
                         tls_ca=read.tls_ca, stats=stats, tier_cache=read.tier_cache)
    if decoder is None:
        yield from batches
        return
    yield from decode_batches(batches, decoder, read.mode, read.topics[0])


def read(topic: str | Sequence[str] | None = None, **kwargs: Any) -> pa.Table:
    """A bounded read as one Arrow table (READ_SCHEMA, or with ``value_format="auto"`` the
    decoded value); arguments as :func:`plan` and :func:`scan`."""
    batches = list(scan(topic, **kwargs))
    if batches:
        return pa.Table.from_batches(batches)
    return READ_SCHEMA.empty_table()


def latest_cut(topic: str, *, data_dir: str | None = None, broker: str | None = None,
               auth_token: str | None = None) -> StreamCut:
    """The broker's last confirmed positions of ``topic``: the end of "everything so far"."""
    read = ReadOptions.from_kwargs(topic, data_dir=data_dir, broker=broker,
                                   auth_token=auth_token)
    with read.enumerator() as enum:
        return enum.latest_cut(topic)


class Following(Iterator[pa.RecordBatch]):
    """What :func:`tail` returns: an iterator of record batches that follows the log until
    :meth:`close` (callable from any thread), the end of a ``with`` block, or the loop that
    iterates it is left (``break``). Each stops the reader threads and broker streams at once."""

    def __init__(self, batches: Iterator[pa.RecordBatch], cancel: Cancel) -> None:
        self._batches = batches
        self._cancel = cancel

    def __next__(self) -> pa.RecordBatch:
        return next(self._batches)

    def close(self) -> None:
        self._cancel.set()  # wakes the iterating thread, wherever it is
        with contextlib.suppress(ValueError):  # "generator already executing": it ends itself
            self._batches.close()  # type: ignore[attr-defined]

    def __enter__(self) -> Following:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tail(topic: str, *, start: BoundLike | None = "latest", key_ranges: int = 1,
         fail_on_data_loss: bool = True, data_dir: str | None = None,
         broker: str | None = None, auth_token: str | None = None) -> Following:
    """Follow ``topic`` from a cut, a time, ``earliest`` or ``latest``, forever.

    The latest cut is taken, and the history before it planned, when this is called, so
    ``latest`` means "what is produced from now on", however late the iterator is first
    advanced. History (if the start lies in the past) is read with the bounded readers up to
    that cut, then one tail split per partition
    and key range follows from exactly there: no gap and no duplicate at the hand-off. A
    broker restart is ridden out (option ``reconnectTimeout``). Close the iterator to stop.
    """
    read = ReadOptions.from_kwargs(topic, start="latest" if start is None else start,
                                   key_ranges=key_ranges, fail_on_data_loss=fail_on_data_loss,
                                   data_dir=data_dir, broker=broker, auth_token=auth_token)
    bound = read.start
    assert isinstance(bound, Offset | StreamCut)  # from_kwargs never makes per-topic cuts
    ranges = KeyRange.split(key_ranges)
    history: Sequence[Split] = ()
    with read.enumerator() as enum:
        cut = bound if isinstance(bound, StreamCut) else enum.latest_cut(topic)
        follow_from = enum.broker
        if not isinstance(bound, StreamCut) and bound.kind is not OffsetKind.LATEST:
            history = enum.plan(replace(read, end=cut).query())
    if follow_from is None:
        raise ConfigError("following a tail needs the broker's address (option 'broker' or "
                          "TIERSTREAM_BROKER)")
    cancel = Cancel()
    return Following(_tail(topic, cut, history, ranges, follow_from, read, cancel), cancel)


def _tail(topic: str, cut: StreamCut, history: Sequence[Split], ranges: list[KeyRange],
          broker: str, read: ReadOptions, cancel: Cancel) -> Iterator[pa.RecordBatch]:
    if history:
        yield from run_splits(history, auth_token=read.auth_token, tls_ca=read.tls_ca,
                              cancel=cancel, tier_cache=read.tier_cache)
    if not cancel.is_set():
        yield from follow(topic, cut, ranges, broker=broker, auth_token=read.auth_token,
                          cancel=cancel)
