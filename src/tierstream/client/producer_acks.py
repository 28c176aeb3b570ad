"""A producer's batches between their write and their ack: acks read in order, up to
``max_in_flight`` per partition; a refusal (fenced by a newer producer of the name, a broker
that does not own the partition, a routing made stale by a scale event); a lost stream,
after which everything unacknowledged is sent again on a new one, for up to the send
timeout. A mixin of :class:`~tierstream.client.producer.Producer`, over its state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.messages import (
    routed,
)
from tierstream.client.retry import gave_up, reconnect_timeout_s
from tierstream.client.stream_io import PartitionStream, StalledError, StreamIO
from tierstream.errors import (
    FencedError,
    NotOwnerError,
    StaleRoutingError,
    TierstreamError,
    UnavailableError,
)
from tierstream.wire.flight import decode, encode, translate_errors

__all__ = ["PartitionAcks"]

log = logging.getLogger(__name__)


class PartitionAcks:
    """The ack side of :class:`~tierstream.client.producer.Producer` (see the module)."""

    name: str
    topic: str
    partitions: int
    send_timeout: float
    max_in_flight: int
    _client: BrokerClient
    _admin: Admin
    _streams: dict[int, PartitionStream]
    _acks: list[dict[str, Any]]

    def _send(self, p: int, batch: pa.RecordBatch, *, pinned: bool = False,
              seq: int | None = None) -> None:
        raise NotImplementedError  # the producer's

    def _add_streams(self) -> None:
        raise NotImplementedError  # the producer's

    def _ensure_stream(self, p: int, stream: PartitionStream) -> StreamIO:
        if stream.io is None:
            stream.io = StreamIO(self._client, {
                "op": "produce", "topic": self.topic, "partition": p, "producer": self.name,
                "routed": self.partitions})
        return stream.io

    def _read_ack(self, p: int, stream: PartitionStream) -> None:
        try:
            self._read_one_ack(p, stream)
        except StaleRoutingError:
            self._follow_scale(p)

    def _follow_scale(self, refusing: int) -> None:
        """The broker refused a batch of partition ``refusing`` as routed by an old count:
        the topic grew. Read the other partitions' acks up to their refusals, ask the broker
        which of the unacknowledged batches it stored before refusing (the last stored
        sequence id per partition: a stream's stored batches are always those before its
        refusal, whatever acks were lost with the connection), read the new count, and send
        the others again, routed by it, in their order."""
        stale = [refusing]
        for p, stream in self._streams.items():
            while p != refusing and stream.unacked:
                try:
                    self._read_one_ack(p, stream)
                except StaleRoutingError:
                    stale.append(p)
                    break
            self._drop(stream)  # its connection names the old count: reconnect
        stored = self._admin.action("producer-state", {"topic": self.topic,
                                                       "producer": self.name})
        refused: list[tuple[int, pa.RecordBatch, bool]] = []
        for p in stale:
            stream, last = self._streams[p], stored.get(str(p))
            for seq, batch in stream.unacked:
                if last is not None and seq <= int(last):
                    self._acks.append({"partition": p, "sequence_id": seq, "duplicate": True,
                                       "messages": batch.num_rows})
                else:
                    refused.append((p, batch, seq in stream.pinned))
            stream.unacked.clear()
            stream.pinned.clear()
        self.partitions = self._admin.get_topic(self.topic).partitions
        self._add_streams()
        for p, batch, pinned in refused:
            if pinned:
                self._send(p, batch, pinned=True)
            else:
                self._send_routed(p, batch)

    def _send_routed(self, p: int, batch: pa.RecordBatch) -> None:
        """Send the rows of ``batch`` (sent to ``p`` before) by the routing in force, also
        if the topic grows again meanwhile."""
        pending = deque([(p, batch)])
        while pending:
            p, batch = pending.popleft()
            routing = self.partitions
            parts = routed(batch, p, routing)
            for i, (q, rows) in enumerate(parts):
                if self.partitions != routing:  # it grew again while sending: route the
                    pending.extendleft(reversed(parts[i:]))  # rest by the newer count
                    break
                self._send(q, rows)

    def _read_one_ack(self, p: int, stream: PartitionStream) -> None:
        if stream.io is None:
            self._recover(p, stream)
        try:
            buf = self._ensure_stream(p, stream).read(self.send_timeout)
            if buf is None:
                self._raise_if_refused(stream, p)
                raise UnavailableError("broker closed the produce stream")
        except StalledError:  # connected, but no ack within send_timeout
            via = stream.io.url if stream.io else None
            self._drop(stream)
            now = time.monotonic()
            stream.stalled_since = stream.stalled_since or now - self.send_timeout
            # a hung broker (an owner followed, the one in use, or both) is left; reconnecting
            # goes on for reconnectTimeout after the stall, as after an unreachable broker
            followed = self._client.unfollow(self.topic, p, via)
            if (followed or len(self._client.urls) > 1) and \
                    now - stream.stalled_since < self.send_timeout + reconnect_timeout_s():
                self._leave(via, f"connected but sent no ack in {self.send_timeout:g}s")
                self._left_hung(via)
                self._recover(p, stream)
                return
            stream.stalled_since = None
            raise self._gave_up(p, stream, f"broker {self._client.url} connected but sent "
                                "no ack") from None
        except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
            self._raise_if_rejected(exc, stream.io.url if stream.io else None, p)
            # a broker that answers, but cannot take the partition yet (opening it, taking it
            # over): 50 ms between tries, doubling to 1 s; for send_timeout without an ack
            now = time.monotonic()
            stream.refused_since = stream.refused_since or now
            if now - stream.refused_since > self.send_timeout:
                stream.refused_since = None
                raise self._gave_up(p, stream, "the brokers kept refusing it ("
                                    f"{stream.refusal or exc})") from None
            stream.backoff = min(max(2 * stream.backoff, 0.05), 1.0)
            threading.Event().wait(stream.backoff)
            self._recover(p, stream)
            return
        ack = decode(buf.to_pybytes(), "ack")
        if "error" in ack:  # the broker could not store the next batch (its error, as ever)
            self._raise_if_rejected(flight.FlightServerError(str(ack["error"])),
                                    stream.io.url if stream.io else None, p)
            self._recover(p, stream)
            return
        seq, _ = stream.unacked.popleft()
        stream.pinned.discard(seq)
        stream.stalled_since = stream.refused_since = stream.refusal = None  # acks flow
        stream.backoff = 0.0
        if ack.get("sequence_id") != seq:
            raise UnavailableError(f"ack for sequence {ack.get('sequence_id')} while waiting "
                                   f"for {seq}")
        self._acks.append(ack)

    def _raise_if_refused(self, stream: PartitionStream, p: int) -> None:
        """The ack stream ended early: a broker that refused the batch (a tierstream error)
        says why when the stream is closed; raise that rather than retry."""
        io, stream.io = stream.io, None
        if io is None:
            return
        try:
            io.close(self.send_timeout)
        except (flight.FlightError, OSError, pa.ArrowException) as exc:
            try:
                self._raise_if_rejected(exc, io.url, p)
            except StaleRoutingError:
                raise  # nothing stored from the refused batch on: it is routed again
            except TierstreamError:
                # the broker stored nothing from the refused batch on: neither it nor what
                # was pipelined behind it is sent again (the call that sent them fails)
                stream.unacked.clear()
                raise

    def _raise_if_rejected(self, exc: BaseException, via: str | None = None,
                           p: int | None = None) -> None:
        """A broker that answers with a tierstream error rejected the batch: do not retry.
        One that refused it as fenced no longer serves the store (another took it over): the
        retry goes to the next broker named, and it is passed over for a while (connection.py).
        One that does not own partition ``p`` names its owner: the retry goes there."""
        try:
            with translate_errors(via or self._client.url):
                raise exc
        except NotOwnerError as refusal:
            if p is not None and refusal.owner_url:
                self._client.follow(self.topic, p, refusal.owner_url)
            elif p is not None:  # no owner to follow: said if the producer gives up
                self._streams[p].refusal = str(refusal)
        except FencedError:
            self._client.fenced(via or self._client.url)
            self._leave(via, "no longer serves the store (fenced)")
        except UnavailableError:
            return
        except TierstreamError:
            raise

    def _left_hung(self, via: str | None) -> None:
        """Every other stream to the hung broker ``via`` is dropped at once (each re-sends
        elsewhere when its ack is read) rather than waiting out a send timeout of its own,
        one partition after another."""
        for q, other in self._streams.items():
            if via is not None and other.io is not None and other.io.url == via:
                self._client.unfollow(self.topic, q, via)
                self._drop(other, 0.0)

    def _leave(self, via: str | None, why: str) -> None:
        """The next broker named, once per broker left (``via``): the other streams follow."""
        if len(self._client.urls) > 1 and via in (None, self._client.url):
            log.warning("producer %s: broker %s %s; trying %s", self.name, self._client.url,
                        why, self._client.next_broker())

    def _recover(self, p: int, stream: PartitionStream) -> None:
        """Reconnect with backoff and re-send every unacknowledged batch, in order."""
        deadline, delay = time.monotonic() + self.send_timeout, 0.05
        while True:
            self._drop(stream)
            try:
                io = self._ensure_stream(p, stream)
                for seq, batch in stream.unacked:
                    io.write(batch, pa.py_buffer(encode({"seq": seq})),
                             deadline - time.monotonic())
                return
            except (flight.FlightError, OSError, pa.ArrowException, UnavailableError) as exc:
                try:
                    self._raise_if_rejected(exc, stream.io.url if stream.io else None, p)
                except StaleRoutingError:
                    # the broker refused a batch as routed by an old count and closed the
                    # stream: its acks say which batches it stored before (dedup answers
                    # those), and the refusal comes where they end (see _follow_scale)
                    return
                if time.monotonic() + delay > deadline:
                    raise self._gave_up(p, stream, f"broker {self._client.url} unreachable"
                                        ) from None
                threading.Event().wait(delay)
                delay = min(delay * 2, 1.0)

    def _gave_up(self, p: int, stream: PartitionStream, why: str) -> UnavailableError:
        """The error for a send timeout: it names the batches whose fate is unknown."""
        return gave_up(self.name, self.topic, p, self.send_timeout, why,
                       [(seq, b.num_rows) for seq, b in stream.unacked])

    def _drop(self, stream: PartitionStream, timeout: float | None = None) -> None:
        if stream.io is not None:
            with contextlib.suppress(Exception):
                stream.io.close(self.send_timeout if timeout is None else timeout)
        stream.io = None
