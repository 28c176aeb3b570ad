"""The broker's wire protocol over Arrow Flight: JSON commands, and errors that survive the trip.

- produce: ``DoPut`` with descriptor command ``{"op": "produce", topic, partition, producer}``;
  each chunk is a batch of :data:`~tierstream.model.message_format.PRODUCE_SCHEMA` with app metadata
  ``{"seq": n}``; the broker answers each chunk with one metadata message, the JSON of an ack,
  in order, or ``{"error": "[tierstream:<code>] ..."}`` when the next one could not be stored
  (the producer closes the stream and retries on a new one; see broker/flight/produce_stream.py).
- consume: ``DoGet`` with a ticket ``{"op": "consume", topic, partition, start, end, ...}``; the
  stream has :data:`~tierstream.model.message_format.MESSAGE_SCHEMA`.
- admin: ``DoAction`` with a JSON body; the result is one JSON document.

A :class:`~tierstream.errors.TierstreamError` raised in the broker reaches the client as the
same class with the same message.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from tierstream.errors import (
    ERRORS_BY_CODE,
    AuthError,
    NotOwnerError,
    ProtocolError,
    TierstreamError,
    UnavailableError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "action_result",
    "decode",
    "decode_positions",
    "encode",
    "encode_positions",
    "error_from_text",
    "error_text",
    "put_batches",
    "server_error",
    "translate_errors",
]

PROTOCOL_VERSION = 1
#: ``[tierstream:CODE] message``, or ``[tierstream:not_owner owner=URL] message``: the owner
#: a client follows, as data
_TAGGED = re.compile(r"\[tierstream:(\w+)(?: owner=([^\]\s]+))?\] "
                     r"(.*?)(?:\. Detail:|\. gRPC client debug context|$)", re.S)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **obj}, separators=(",", ":")).encode()


def decode(data: bytes | memoryview | None, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(data or b"{}"))
    except ValueError:
        raise ProtocolError(f"malformed {what}: not JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"malformed {what}: expected a JSON object")
    version = obj.pop("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what} uses protocol version {version}; this side speaks {PROTOCOL_VERSION}"
        )
    return obj


def encode_positions(batch: pa.RecordBatch) -> dict[str, str]:
    """The message positions of ``batch`` (one partition) for an ack or nack body, as runs:
    base64 of a little-endian int64 array of (segment id, entry id, first batch index, count)
    per run of consecutive indexes of one entry. A received batch is a few entries' runs, so
    its ack is a few dozen bytes, not 24 bytes a message for the broker to decode."""
    segment, entry, index = (np.asarray(batch.column(name).to_numpy(), dtype=np.int64)
                             for name in ("segment_id", "entry_id", "batch_index"))
    starts = np.flatnonzero(np.concatenate((
        [True], (segment[1:] != segment[:-1]) | (entry[1:] != entry[:-1])
        | (index[1:] != index[:-1] + 1)))) if len(segment) else np.empty(0, np.int64)
    counts = np.diff(np.append(starts, len(segment)))
    runs = np.stack((segment[starts], entry[starts], index[starts], counts), axis=1)
    return {"runs": base64.b64encode(np.ascontiguousarray(runs, dtype="<i8").tobytes()).decode()}


def decode_positions(body: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`encode_positions` wrote, as three int64 arrays of one length (a body of a
    client before runs, with the three arrays whole, is read too)."""
    if "runs" not in body:
        segment, entry, index = (np.frombuffer(base64.b64decode(body[name]), dtype="<i8")
                                 for name in ("segment_id", "entry_id", "batch_index"))
        if not len(segment) == len(entry) == len(index):
            raise ProtocolError("malformed positions: arrays of different lengths")
        return segment, entry, index
    flat = np.frombuffer(base64.b64decode(body["runs"]), dtype="<i8")
    if len(flat) % 4 or (len(flat) and flat[3::4].min() < 1):
        raise ProtocolError("malformed positions: runs are four numbers, counts positive")
    runs = flat.reshape(-1, 4).astype(np.int64)
    counts = runs[:, 3]
    firsts = np.cumsum(counts) - counts  # where each run starts in the output
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)
    return (np.repeat(runs[:, 0], counts), np.repeat(runs[:, 1], counts),
            np.repeat(runs[:, 2], counts) + step)


def put_batches(reader: flight.MetadataRecordBatchReader) -> Iterator[pa.RecordBatch]:
    """The record batches a DoPut stream's client sends, until it is done writing."""
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        if chunk.data is not None:
            yield chunk.data


def server_error(exc: TierstreamError) -> Exception:
    """The Flight error that carries ``exc`` to the client."""
    error: Exception  # pyarrow.flight is untyped
    if isinstance(exc, AuthError):
        error = flight.FlightUnauthenticatedError(str(exc))
    else:
        error = flight.FlightServerError(error_text(exc))
    return error


def error_text(exc: TierstreamError) -> str:
    """``exc`` tagged with its code, as a client turns it back (:func:`translate_errors`)."""
    if isinstance(exc, NotOwnerError) and exc.owner_url:
        return f"[tierstream:{exc.code} owner={exc.owner_url}] {exc}"
    return f"[tierstream:{exc.code}] {exc}"


def _tagged(match: re.Match[str]) -> TierstreamError:
    """The error a :data:`_TAGGED` match names."""
    code, owner, message = match.group(1), match.group(2), match.group(3).strip()
    if code == NotOwnerError.code:
        return NotOwnerError(message, owner_url=owner)
    return ERRORS_BY_CODE.get(code, TierstreamError)(message)


def action_result(value: Any) -> Iterator[bytes]:
    """What a DoAction answers: ``{"result": value}`` (a client reads ``["result"]``)."""
    return iter([encode({"result": value})])


def error_from_text(text: str) -> TierstreamError:
    """The error :func:`error_text` tagged (a plain text: UnavailableError with it)."""
    match = _TAGGED.search(text)
    if match is None:
        return UnavailableError(text)
    return _tagged(match)


@contextmanager
def translate_errors(url: str, what: str = "broker") -> Iterator[None]:
    """Turn Flight errors raised inside the block back into tierstream errors. ``what`` names
    the endpoint in messages (the broker, or a bookie endpoint)."""
    hint = "is it running? (tierstream broker start; --broker / TIERSTREAM_BROKER) " \
        if what == "broker" else ""
    try:
        yield
    except flight.FlightUnauthenticatedError:
        raise AuthError(
            f"{what} {url} denied the call: missing or wrong token "
            "(set --auth-token or TIERSTREAM_AUTH_TOKEN)"
        ) from None
    except flight.FlightUnavailableError as exc:
        raise UnavailableError(
            f"cannot reach the {what} at {url}: {hint}[{_first_line(exc)}]"
        ) from None
    except flight.FlightTimedOutError:
        raise UnavailableError(f"the {what} at {url} did not answer in time") from None
    except flight.FlightError as exc:
        match = _TAGGED.search(str(exc))
        if match:
            raise _tagged(match) from None
        raise UnavailableError(f"{what} {url} failed: {_first_line(exc)}") from None
    except OSError as exc:
        raise UnavailableError(f"cannot reach the {what} at {url}: {exc}") from None
    except pa.ArrowNotImplementedError as exc:  # gRPC's UNIMPLEMENTED, or an HTTP/2 404
        raise UnavailableError(f"the {what} at {url} answered, but not as a tierstream "
                               f"{what} (another service on that port?) "
                               f"[{_first_line(exc)}]") from None


def _first_line(exc: BaseException) -> str:
    """The gist of a Flight error: its first line, without gRPC's debug context."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return text.splitlines()[0].split(". gRPC client debug context")[0]
