"""Reading a topic through the broker: bounded reads, following reads that ride out broker
restarts (:func:`consume_stream`), and merging partition streams."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Self

import pyarrow as pa

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.retry import Backoff, reconnect_timeout_s
from tierstream.errors import ConfigError, UnavailableError
from tierstream.model import arguments
from tierstream.model.data_loss import lost_segments, report_data_loss
from tierstream.model.names import TopicName
from tierstream.model.positions import KeyRange, Offset, OffsetKind, Position
from tierstream.splits.split import BoundLike, StreamCut, as_bound, check_window
from tierstream.util.fanin import DONE, Cancel, drain, put, start_reader
from tierstream.wire.flight import translate_errors

__all__ = ["TopicReader", "check_ranges", "consume_stream", "pump_batches", "read"]

log = logging.getLogger(__name__)


def check_ranges(key_ranges: Iterable[KeyRange] | None) -> list[list[int]]:
    """``key_ranges`` (KeyRange objects, or None for every key) as the wire carries them."""
    if key_ranges is None:
        return []
    if isinstance(key_ranges, str | bytes | KeyRange) or not isinstance(key_ranges, Iterable):
        raise ConfigError(f"invalid key_ranges {key_ranges!r}: expected a list of KeyRange, "
                          "or None for every key")
    ranges = list(key_ranges)
    for r in ranges:
        if not isinstance(r, KeyRange):
            raise ConfigError(f"invalid key range {r!r} in key_ranges: expected a KeyRange")
    return [r.to_list() for r in ranges]


def read(topic: str, *, partition: int | None = None,
         start: BoundLike | None = None, end: BoundLike | None = None,
         key_ranges: Iterable[KeyRange] | None = None,
         broker: str | None = None, auth_token: str | None = None,
         tls_ca: bytes | str | None = None, fail_on_data_loss: bool = True) -> TopicReader:
    """Read a topic through the broker (every partition, or one ``partition``; a position as
    ``start`` or ``end`` names its partition, so it is the partition read).

    ``start`` and ``end`` may be stream cuts of ``topic`` (a position per partition, as
    ``Admin.latest_cut`` or ``tierstream read --cut-out`` give them): a partition the start
    cut lacks (grown since) is read from its beginning, one the end cut lacks not at all.
    The partition streams are opened before this returns, so ``latest`` (as start or end) is
    pinned at call time for all partitions. ``end=None`` follows the tail until the reader is
    closed; a bounded ``end`` finishes. Batches have
    :data:`~tierstream.model.message_format.MESSAGE_SCHEMA` and keep each partition's order.

    Raises DataLossError when retention deleted data from the window (a time or position
    start), as every bounded reader does; ``fail_on_data_loss=False`` reads what survives and
    logs what was skipped.
    """
    start, end = as_bound(start, "start"), as_bound(end, "end")
    check_window(start, end)
    fail_on_data_loss = arguments.flag(fail_on_data_loss, "fail_on_data_loss")
    return TopicReader(topic, partition=partition, start=start, end=end, key_ranges=key_ranges,
                       broker=broker, auth_token=auth_token, tls_ca=tls_ca,
                       fail_on_data_loss=fail_on_data_loss)


class TopicReader:
    """Iterator of record batches over open partition streams; see :func:`read`."""

    def __init__(self, topic: str, *, partition: int | None, start: Offset | StreamCut | None,
                 end: Offset | StreamCut | None, key_ranges: Iterable[KeyRange] | None,
                 broker: str | None, auth_token: str | None,
                 tls_ca: bytes | str | None = None, fail_on_data_loss: bool = True) -> None:
        name = str(TopicName.parse(topic))
        for cut in (start, end):
            if isinstance(cut, StreamCut) and cut.topic != name:
                raise ConfigError(f"the stream cut is of topic {cut.topic!r}, not {name!r}")
        partition = _partition_of(partition, *(b for b in (start, end)
                                               if not isinstance(b, StreamCut)))
        ranges = check_ranges(key_ranges)
        self._client = BrokerClient(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._readers: list[Any] = []
        self._cancel = Cancel()
        try:
            # the whole list: the first broker named may be the one that is down
            with Admin(self._client.broker, auth_token=auth_token,
                       tls_ca=self._client.tls_ca) as admin:
                count = admin.get_topic(name).partitions
                if partition is not None and not 0 <= partition < count:
                    raise ConfigError(f"invalid partition {partition} for {name!r}: it has "
                                      f"0..{count - 1}")
                parts = [p for p in ([partition] if partition is not None else range(count))
                         if not (isinstance(end, StreamCut) and end.get(p) is None)]
                tickets = []
                for p in parts:
                    first, last = _of_partition(start, p), _of_partition(end, p)
                    _check_data_loss(admin, name, [p], first, last, fail=fail_on_data_loss)
                    pinned = _pinned_starts(admin, name, [p], first or Offset.earliest(),
                                            following=end is None)
                    tickets.append({"op": "consume", "topic": name, "key_ranges": ranges,
                                    "partition": p, "start": pinned[p],
                                    "end": None if last is None else last.to_dict()})
            for t in tickets:  # each returns once the broker resolved its offsets
                self._readers.append(self._client.consume(t))
        except BaseException:
            self.close()
            raise
        if end is None:  # following: each partition rides out broker restarts
            streams = [consume_stream(self._client, t, first=r, cancel=self._cancel)
                       for t, r in zip(tickets, self._readers, strict=True)]
            # always through threads, even for one partition: the caller then waits on a
            # queue, which Ctrl-C interrupts, not inside a Flight read, which it cannot
            self._iter = _merge(streams, self._cancel)
        else:
            self._iter = _chain(self._client.url, self._readers)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self

    def __next__(self) -> pa.RecordBatch:
        return next(self._iter)

    def close(self) -> None:
        self._cancel.set()
        for r in self._readers:
            r.cancel()
        close = getattr(getattr(self, "_iter", None), "close", None)
        if close is not None:
            close()
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _of_partition(bound: Offset | StreamCut | None, p: int) -> Offset | None:
    """A bound as partition ``p`` reads it: a cut's position there (none: from the start)."""
    if isinstance(bound, StreamCut):
        pos = bound.get(p)
        return None if pos is None else Offset.at_position(pos)
    return bound


def _partition_of(partition: int | None, *bounds: Offset | None) -> int | None:
    """The partition a read is about: ``partition``, or the one its position bounds name."""
    if partition is not None and (isinstance(partition, bool) or not isinstance(
            partition, int) or partition < 0):
        raise ConfigError(f"invalid partition {partition!r}: expected a partition number "
                          ">= 0, or None for all")
    named = {b.position.partition for b in bounds
             if b is not None and b.kind is OffsetKind.POSITION and b.position is not None}
    if partition is not None:
        named.add(partition)
    if len(named) > 1:
        raise ConfigError(f"the read names partitions {sorted(named)}: a position is in one "
                          "partition, so --from, --to and --partition must agree")
    return named.pop() if named else None


def _pinned_starts(admin: Admin, topic: str, parts: list[int], start: Offset, *,
                   following: bool) -> dict[int, dict[str, Any]]:
    """Each partition's start as the ticket carries it. A following read pins ``latest`` to
    the positions of now: after a broker restart it resumes there, not at a "latest" taken
    again on reconnect (which skipped what was produced while it reconnected)."""
    if following and start.kind is OffsetKind.LATEST:
        ends = admin.ends(topic)
        return {p: Offset.at_position(ends[p]).to_dict() for p in parts}
    return {p: start.to_dict() for p in parts}


def _check_data_loss(admin: Admin, topic: str, parts: list[int], start: Offset | None,
                     end: Offset | None, *, fail: bool) -> None:
    """The planner's data-loss rule (data_loss.py) for a read through the broker: a window
    starting at a time or a position that retention cut into fails, or says what it skips."""
    if start is None or start.kind not in (OffsetKind.TIME, OffsetKind.POSITION):
        return  # earliest and latest mean what is there now: nothing of them is lost
    deleted = admin.deleted_segments(topic)
    if not deleted:
        return
    t1 = end.time_ms if end is not None and end.kind is OffsetKind.TIME else None
    for p in parts:
        mine = [d for d in deleted if d["partition"] == p]
        if start.kind is OffsetKind.TIME:
            lost = lost_segments(mine, t0=start.time_ms, t1=t1)
        else:
            assert start.position is not None
            lost = lost_segments(mine, from_segment=start.position.segment_id, t1=t1)
        report_data_loss(topic, p, lost, fail=fail)


def _chain(url: str, readers: list[Any]) -> Iterator[pa.RecordBatch]:
    for reader in readers:
        yield from flight_batches(url, reader)


def flight_batches(url: str, reader: Any) -> Iterator[pa.RecordBatch]:
    """The non-empty batches of one Flight stream, errors as tierstream errors."""
    with translate_errors(url):
        for chunk in reader:
            if chunk.data is not None and chunk.data.num_rows:
                yield chunk.data


def consume_stream(client: BrokerClient, ticket: dict[str, Any], *, first: Any = None,
                   cancel: Cancel | None = None, reconnect_timeout_ms: int | None = None
                   ) -> Iterator[pa.RecordBatch]:
    """One partition's consume stream (``ticket`` as the broker takes it) that rides out broker
    restarts: when the broker goes away it reconnects with backoff from the position after the
    last batch it delivered, so nothing is skipped or repeated, for up to
    ``reconnect_timeout_ms`` (the ``reconnectTimeout`` option) without progress; then it raises
    one UnavailableError. ``first`` is an already open stream for the ticket; setting
    ``cancel`` ends the stream at once."""
    ticket = dict(ticket)
    reader = first
    backoff: Backoff | None = None
    while True:
        unregister = None
        try:
            if reader is None:
                reader = client.consume(ticket)  # the broker answered: the outage is over
                if backoff is not None:
                    log.info("%s partition %s: reconnected after %d attempt(s)",
                             ticket.get("topic"), ticket.get("partition"), backoff.attempts)
                backoff = None  # a later outage gets its own reconnectTimeout
            if cancel is not None:
                unregister = cancel.register(reader.cancel)
            for batch in flight_batches(client.url, reader):
                i = batch.num_rows - 1
                ticket["start"] = Offset.at_position(Position(
                    batch.column("partition")[i].as_py(), batch.column("segment_id")[i].as_py(),
                    batch.column("entry_id")[i].as_py(),
                    batch.column("batch_index")[i].as_py() + 1)).to_dict()
                yield batch
            if ticket.get("end") is not None or (cancel is not None and cancel.is_set()):
                return  # a bounded stream that reached its end
            # A following stream has no end: the broker closed it (a clean shutdown).
            raise UnavailableError(f"the broker at {client.url} closed the stream")
        except UnavailableError as exc:
            if cancel is not None and cancel.is_set():
                return  # cancelled by the consumer: not an outage
            if backoff is None:
                backoff = Backoff(reconnect_timeout_s(reconnect_timeout_ms), cancel=cancel)
                log.info("%s partition %s: broker unavailable, reconnecting for up to %gs "
                            "(%s)", ticket.get("topic"), ticket.get("partition"),
                            backoff.timeout_s, exc)
            if not backoff.wait():
                if cancel is not None and cancel.is_set():
                    return
                raise UnavailableError(
                    f"lost the broker at {client.url} while reading {ticket.get('topic')!r} "
                    f"partition {ticket.get('partition')}: it stayed unavailable for "
                    f"{backoff.elapsed_s():.0f}s ({backoff.attempts} reconnects; option "
                    f"reconnectTimeout {backoff.timeout_s:g}s); resume from "
                    f"{Offset.from_dict(ticket['start'])}") from None
        finally:
            if unregister is not None:
                unregister()
            if reader is not None:
                reader.cancel()
            reader = None


def pump_batches(batches: Iterable[pa.RecordBatch], out: queue.Queue[Any],
          stop: threading.Event | Cancel) -> None:
    """Put ``batches`` on ``out`` until they end or ``stop`` is set; an error is put there
    too, for the consuming thread to raise."""
    try:
        for batch in batches:
            if not put(out, batch, stop):
                return
    except Exception as exc:
        if not stop.is_set():
            put(out, exc, stop)


def _merge(streams: list[Iterator[pa.RecordBatch]], stop: Cancel) -> Iterator[pa.RecordBatch]:
    """Unbounded partition streams, merged as batches arrive (per-partition order)."""
    out: queue.Queue[Any] = queue.Queue(maxsize=64)

    def pump(stream: Iterator[pa.RecordBatch]) -> None:
        try:
            pump_batches(stream, out, stop)
        finally:
            put(out, DONE, stop)

    for i, st in enumerate(streams):
        start_reader(pump, st, name=f"tierstream-merge-{i}")
    try:
        yield from drain(out, len(streams))
    finally:
        stop.set()
