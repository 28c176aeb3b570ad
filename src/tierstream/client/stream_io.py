"""A produce (or transaction staging) stream's Flight calls, made on a thread of their own.

pyarrow's Flight calls on a DoPut stream (opening it, writing a batch, reading an ack, closing
it) block inside C++ with no deadline, and a signal does not interrupt them: a broker that is
alive but stuck (a hung disk, a stopped process) would hold the producer's caller there
forever, past ``send_timeout`` and deaf to Ctrl-C. Here each call runs, in order, on one daemon
thread per stream while the caller waits for it with a deadline; a call that misses it leaves
the stream stuck (:class:`StalledError`), and the producer gives up on it as on an unreachable
broker. The thread alone holds the stream's objects: pyarrow's writer blocks in its destructor
too, so a stuck stream is released by its own thread if the broker ever answers, never by the
caller.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tierstream.client.connection import BrokerClient
from tierstream.errors import UnavailableError
from tierstream.util.fanin import start_reader

__all__ = ["PartitionStream", "StalledError", "StreamIO"]

_Calls = queue.SimpleQueue[tuple[Future[Any], str, tuple[Any, ...]] | None]

#: the call queues of stream threads still serving: at exit each is told to end, so that its
#: thread releases its stream before the interpreter finalizes (``fanin.start_reader``'s exit
#: join waits for it: a thread still inside Flight then would abort the process)
_SERVING: set[_Calls] = set()


@atexit.register  # registered after fanin's join, so it runs before it
def _end_streams() -> None:
    for calls in list(_SERVING):
        calls.put(None)


@dataclass
class PartitionStream:
    """A producer's state of one partition: its stream, its sequence ids, what awaits an ack."""

    io: StreamIO | None = None  # the open produce stream, if any
    next_seq: int = 0
    unacked: deque[tuple[int, pa.RecordBatch]] = field(default_factory=deque)
    pinned: set[int] = field(default_factory=set)  # sent to a partition the caller chose
    #: since when brokers connected but sent no ack in time (monotonic s; None: acks flow)
    stalled_since: float | None = None
    backoff: float = 0.0  # seconds before the next try after a refusal (0: acks flow)
    refused_since: float | None = None  # since when brokers refused it (None: acks flow)
    refusal: str | None = None  # the last refusal that named no owner to follow


class StalledError(UnavailableError):
    """The broker accepted the stream but did not answer a call in time."""


class StreamIO:
    """One DoPut stream (``command`` as :meth:`BrokerClient.produce` takes it), opened on its
    thread before the first call runs; an error opening it is raised by that call."""

    def __init__(self, client: BrokerClient, command: Mapping[str, Any]) -> None:
        #: the broker it goes to: the owner followed or the broker in use when it was made,
        #: then the one it was opened to (a stall is that broker's: the producer leaves it)
        self.url = client.url_for(command)
        self._calls: _Calls = queue.SimpleQueue()
        self.stalled = False
        self.interrupted = False  # a caller left a call that its thread still runs
        self._closed = False
        _SERVING.add(self._calls)
        start_reader(_serve, self, client, dict(command), name="tierstream-produce-io")

    def write(self, batch: pa.RecordBatch, metadata: pa.Buffer | None, timeout: float) -> None:
        self._call("write", (batch, metadata), timeout)

    def done_writing(self, timeout: float) -> None:
        """Say that no batch follows (the broker then sends its last ack)."""
        self._call("done", (), timeout)

    def read(self, timeout: float) -> pa.Buffer | None:
        """The next ack (None when the broker ended the stream)."""
        result: pa.Buffer | None = self._call("read", (), timeout)
        return result

    def close(self, timeout: float) -> None:
        """Close the stream: the broker's error, if it refused something, is raised. A stalled
        stream is not waited for (its thread is still in the call that stalled); closing a
        closed one does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.stalled or self.interrupted:
            self._calls.put(None)
            return
        try:
            self._run("close", (), timeout)
        finally:
            self._calls.put(None)

    def _call(self, name: str, args: tuple[Any, ...], timeout: float) -> Any:
        if self._closed:
            raise UnavailableError(f"the stream to the broker at {self.url} is closed")
        return self._run(name, args, timeout)

    def _run(self, name: str, args: tuple[Any, ...], timeout: float) -> Any:
        if self.stalled:
            raise StalledError(f"the broker at {self.url} stopped answering this stream")
        if self.interrupted:
            raise UnavailableError(f"a call on this stream to the broker at {self.url} was "
                                   "interrupted: its answer is not known")
        future: Future[Any] = Future()
        self._calls.put((future, name, args))
        try:
            return future.result(max(timeout, 0.0))
        except FutureTimeout:
            self.stalled = True
            raise StalledError(f"the broker at {self.url} did not answer in {timeout:g}s "
                               f"(a {name} on its produce stream)") from None
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is exc:
                raise  # the call's own error (a broker's refusal): its answer is known
            # the wait was interrupted (Ctrl-C): the call may still run and take its answer
            # (an ack that a later read would wait for in vain), so the stream is not used
            # again; the producer reconnects and re-sends what is unacknowledged
            if not future.cancel():
                self.interrupted = True
            raise


def _serve(io: StreamIO, client: BrokerClient, command: dict[str, Any]) -> None:
    try:
        _run_calls(io, client, command)
    finally:
        _SERVING.discard(io._calls)


def _run_calls(io: StreamIO, client: BrokerClient, command: dict[str, Any]) -> None:
    writer = reader = None
    opening: BaseException | None = None
    calls = io._calls
    try:
        writer, reader, io.url = client.produce(command)
    except BaseException as exc:  # raised by the first call
        opening = exc
    try:
        while (item := calls.get()) is not None:
            future, name, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if opening is not None:
                    raise opening
                if name == "write":
                    batch, metadata = args
                    if metadata is None:
                        writer.write_batch(batch)  # type: ignore[union-attr]
                    else:
                        writer.write_with_metadata(batch, metadata)  # type: ignore[union-attr]
                    future.set_result(None)
                elif name == "done":
                    writer.done_writing()  # type: ignore[union-attr]
                    future.set_result(None)
                elif name == "read":
                    future.set_result(reader.read())  # type: ignore[union-attr]
                else:
                    writer.close()  # type: ignore[union-attr]
                    future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)
    finally:
        # a stream given up on (stalled, interrupted, dropped) is closed here once its last
        # call returned, its error moot: left to Arrow's destructor, the error is printed to
        # the user's stderr ("Close() failed: IOError: ..."). (Arrow's close is idempotent:
        # a stream a call closed is not closed again.)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
