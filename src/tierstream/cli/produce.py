"""``tierstream produce``: JSON lines from stdin as they arrive, each checked, or a
synthetic click stream (``--generate``)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tierstream.cli.common import (
    BrokerOpt,
    QuietOpt,
    TlsCaOpt,
    TokenOpt,
    app,
    err,
    progress_bar,
)
from tierstream.errors import ConfigError, UnavailableError
from tierstream.options import DEFAULT_BROKER_URL
from tierstream.util.timeutil import parse_time_ms

if TYPE_CHECKING:
    from tierstream.client import Admin, Producer


@app.command()
def produce(
    topic: Annotated[str, typer.Argument(help="tenant/namespace/topic")],
    generate: Annotated[int | None, typer.Option(help="Generate N synthetic messages instead "
                                                      "of reading JSON lines from stdin.")] = None,
    keys: Annotated[int, typer.Option(help="Distinct keys for --generate.")] = 100,
    start_time: Annotated[str | None, typer.Option(help=(
        "Publish (and event) time of the first generated message (ISO-8601 or epoch ms). "
        "A publish time before the partition's newest message is stamped with that newer "
        "time instead (the command warns how many), so import history into a new topic."))]
        = None,
    step_ms: Annotated[int, typer.Option(help="Publish-time step between generated "
                                              "messages.")] = 0,
    value_size: Annotated[int, typer.Option(help="Approximate bytes per generated value.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Messages per batch (entry).")] = 1000,
    producer_name: Annotated[str | None, typer.Option("--name", help=(
        "Producer name: a replay of the same input under the same name stores only what "
        "is missing (each message's sequence id is its stdin line number, or its "
        "'sequence_id' field; with --generate, its index); other input whose ids the name "
        "stored is refused before anything is sent."))] = None,
    quiet: QuietOpt = False,
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Produce messages: JSON lines from stdin, or --generate N synthetic clicks.

    A stdin line is {"value": "...", "key": "...", "event_time": ms, "properties": {...},
    "publish_time": ms} (only value is required; "value_b64" for binary values; an object
    value for a topic with a schema, which checks and encodes it). Lines are
    sent as they arrive (batched for up to 50 ms or --batch-size lines), so a live source can
    be piped in. Each line is checked: at a bad one, everything before it has been sent and
    nothing after it is, and the error names the line. publish_time never runs backwards in a
    partition: a time before the partition's newest message is stamped with that newer time,
    and the command warns how many were (event_time keeps what was asked).

    With --name, the input is replayable: message N of it (its line number, or a
    "sequence_id" field whose values increase) is stored at most once under that name, so
    running the same command on the same input again, or after a crash, stores only what
    is missing, and says how many it skipped. Other input under a name that stored messages
    with its ids (each partition's last stored message is compared) is refused before any
    of it is sent: its lines would otherwise be skipped as stored.

    Example: tierstream produce acme/web/clicks --generate 100000 --keys 50
    --start-time 2026-11-01T00:00:00Z --step-ms 60
    """
    from tierstream.client import Admin, Producer

    if generate is not None and not 0 <= generate <= 10**12:
        raise ConfigError(f"invalid --generate {generate}: expected a count from 0 to 10^12")
    if keys < 1:
        raise ConfigError(f"invalid --keys {keys}: expected >= 1")
    if step_ms < 0:
        raise ConfigError(f"invalid --step-ms {step_ms}: expected >= 0")
    t0 = parse_time_ms(start_time, what="--start-time") if start_time is not None else None
    if batch_size < 1:
        raise ConfigError(f"invalid --batch-size {batch_size}: expected >= 1")
    total: int | None
    line_of: dict[int, int] = {}  # id of a message from stdin -> its line number
    if generate is None:
        total = None
        stdin = _stdin_batches(batch_size, linger_s=0.05, numbered=producer_name is not None,
                               line_of=line_of)
        first = next(stdin, None)  # the first lines are read and checked before connecting
        chunks: Iterator[list[dict[str, Any]]] = itertools.chain(
            [first] if first is not None else [], stdin)
    else:
        total = generate
        chunks = _chunked(_generated(generate, keys, t0, step_ms, value_size,
                                     numbered=producer_name is not None), batch_size * 8)
    sent = replayed = 0
    sending = 0  # messages in the send under way
    in_flight: int | None = None  # set when Ctrl-C stopped the run: how many were being sent
    restamped = 0
    try:
        with Producer(topic, broker=broker, auth_token=auth_token, name=producer_name,
                      batch_size=batch_size) as producer, \
                progress_bar(total is not None and not quiet) as progress:
            task = progress.add_task("producing", total=total)
            if producer_name is not None and generate is None:
                chunks = _replayed_or_new(chunks, producer, producer_name,
                                          Admin(broker, auth_token=auth_token))
            for chunk in chunks:
                sending = len(chunk)
                try:
                    acks = producer.send_many(chunk)
                except ConfigError as exc:  # "message i" of the call: say its stdin line
                    raise _at_line(exc, chunk, line_of) from None
                finally:
                    for message in chunk:
                        line_of.pop(id(message), None)
                sending = 0
                restamped += sum(int(a.get("restamped") or 0) for a in acks)
                skipped = sum(int(a.get("messages") or 0) for a in acks if a.get("duplicate"))
                sent += len(chunk) - skipped
                replayed += skipped
                progress.update(task, completed=sent)
    except NotAReplay:
        raise
    except ConfigError as exc:
        if generate is None:
            raise ConfigError(f"{exc}; the {sent} message(s) before it were sent to "
                              f"{topic}, none after it") from None
        raise
    except UnavailableError as exc:  # the producer gave up: its advice is a Python call
        text = str(exc)
        if "; flush() re-sends them" not in text:
            raise
        again = (f"producing the same input again as --name {producer_name} stores only "
                 "what is missing") if producer_name else (
            "producing the input again may store them twice: give --name to make a re-run "
            "store only what is missing")
        raise UnavailableError(f"{text.split('; flush() re-sends them')[0]}; at least {sent:,} "
                               f"message(s) before them were stored; {again}") from None
    except KeyboardInterrupt:  # out of the producer first: it does not wait for acks then
        in_flight = sending
    if in_flight is not None:
        again = (f"; producing the same input again as --name {producer_name} stores only "
                 "what is missing") if producer_name else ""
        maybe = f", and up to {in_flight:,} more may have been as Ctrl-C came" \
            if in_flight else ""
        err.print(f"interrupted: {sent:,} message(s) were stored in {topic}{maybe}{again}",
                  highlight=False)
        raise typer.Exit(130)
    err.print(f"produced {sent} message(s) to {topic}", highlight=False)
    if replayed:
        err.print(f"skipped {replayed:,} message(s) that producer {producer_name!r} had stored "
                  "already (by sequence id: a replay stores nothing twice)", highlight=False)
    if restamped:
        err.print(f"[yellow]warning:[/yellow] {restamped:,} of {sent:,} message(s) asked for a "
                  "publish time before the newest message already in their partition and were "
                  "stamped with that newer time instead (publish_time never runs backwards "
                  "within a partition), so time windows (--from/--to) find them there; their "
                  "event_time keeps the time asked for. To import history under its own "
                  "times, produce it into a new topic.", markup=True, highlight=False)


class NotAReplay(ConfigError):
    """Input under ``--name`` whose ids the name stored, but not that input."""


def _replayed_or_new(chunks: Iterator[list[dict[str, Any]]], producer: Producer, name: str,
                     admin: Admin) -> Iterator[list[dict[str, Any]]]:
    """The chunks, once the input is seen to be new under ``--name`` or a replay of what the
    name stored: a message whose sequence id the name stored in some partition is compared
    with that partition's last stored message (key and value), and what may be new is held
    until every such message was, so that another input under the same name is refused
    before anything of it is stored (its lines are not a replay: skipping them would lose
    them)."""
    from tierstream.client.messages import encoded_messages

    with admin:
        stored = admin.action("producer-state", {"topic": producer.topic, "producer": name,
                                                 "messages": True})
    pending = {int(last["sequence_id"]): last for last in stored.values() if last}
    top = max(pending, default=-1)
    held: list[dict[str, Any]] = []

    def refuse(why: str) -> ConfigError:
        return NotAReplay(
            f"--name {name}: {why}; nothing of it was sent. A named run stores an input "
            "once, and a replay of it stores only what is missing: for other input give "
            f"another --name, or 'sequence_id' fields above {top}")

    for chunk in chunks:
        if not pending:
            yield chunk
            continue
        for i, message in enumerate(chunk):
            seq = int(message["sequence_id"])
            if seq > top:  # past every stored id, and one of them was not in the input
                raise refuse(f"this input is not the one stored under that name: it has no "
                             f"message {min(pending)}, which the name stored")
            last = pending.pop(seq, None)
            if last is not None and "value_sha256" in last:
                value = encoded_messages(producer.encoder, producer.topic, [message])[0].value
                data = value.encode() if isinstance(value, str) else bytes(value)
                if (message.get("key") != last.get("key")
                        or hashlib.sha256(data).hexdigest() != last["value_sha256"]):
                    raise refuse(f"this input is not the one stored under that name: its "
                                 f"message {seq} differs from the one stored as {seq}")
            held.append(message)
            if not pending:
                yield held + chunk[i + 1:]
                held = []
                break
    if pending and held:
        raise refuse(f"this input ends before message {min(pending)}, which the name "
                     "stored last, so it cannot be told to be a replay")
    if held:
        yield held


def _at_line(exc: ConfigError, chunk: list[dict[str, Any]], line_of: dict[int, int]
             ) -> ConfigError:
    """``exc`` about "message i" of a send, as the stdin line that message came from (one
    way of counting in every message of the command)."""
    match = re.match(r"message (\d+)\b", str(exc))
    if match is None or int(match.group(1)) >= len(chunk):
        return exc
    line = line_of.get(id(chunk[int(match.group(1))]))
    if line is None:
        return exc
    return type(exc)(f"stdin line {line}{str(exc)[match.end():]}")


def _stdin_batches(batch_size: int, *, linger_s: float, numbered: bool = False,
                   line_of: dict[int, int] | None = None) -> Iterator[list[dict[str, Any]]]:
    """Checked messages from stdin lines as they arrive: a batch goes out when it has
    ``batch_size`` lines or its first line waited ``linger_s``. A bad line ends it, after the
    lines before it were handed out."""
    import queue
    import threading
    import time

    lines: queue.Queue[tuple[int, str] | None] = queue.Queue(maxsize=4 * batch_size)

    def read() -> None:  # a thread, so that lingering does not wait on a blocking readline
        try:
            for lineno, line in enumerate(sys.stdin, 1):
                lines.put((lineno, line))
        finally:
            lines.put(None)

    threading.Thread(target=read, name="tierstream-stdin", daemon=True).start()
    batch: list[dict[str, Any]] = []
    deadline = 0.0
    last_seq: int | None = None
    while True:
        try:
            item = lines.get(timeout=max(0.0, deadline - time.monotonic()) if batch else None)
        except queue.Empty:
            yield batch
            batch = []
            continue
        if item is None:
            if batch:
                yield batch
            return
        try:
            message = _stdin_message(*item, numbered=numbered)
        except ConfigError:
            if batch:
                yield batch
            raise
        if message is None:
            continue
        seq = message.get("sequence_id")
        if seq is not None:
            if last_seq is not None and seq <= last_seq:
                if batch:
                    yield batch
                raise ConfigError(f"stdin line {item[0]}: sequence_id {seq} does not increase "
                                  f"(the line before has {last_seq})")
            last_seq = seq
        if not batch:
            deadline = time.monotonic() + linger_s
        if line_of is not None:
            line_of[id(message)] = item[0]
        batch.append(message)
        if len(batch) >= batch_size:
            yield batch
            batch = []


def _stdin_message(lineno: int, line: str, *, numbered: bool = False
                   ) -> dict[str, Any] | None:
    """One stdin line as a message (None for a blank line); ConfigError naming the line.
    ``numbered`` (a named producer): the message's sequence id is its ``sequence_id`` field,
    else the line number."""
    if not line.strip():
        return None
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # bytes stdin could not decode arrive as lone surrogates
        raise ConfigError(f"stdin line {lineno} is not UTF-8 text: {line.strip()[:80]!r} "
                          "(binary values go in value_b64)") from None
    try:
        obj = json.loads(line)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"stdin line {lineno} has a lone surrogate escape (such as "
                          "\\ud800), which is not Unicode text: give the character's whole "
                          "pair, or the bytes in value_b64") from None
    except ValueError:
        raise ConfigError(f"stdin line {lineno} is not JSON: {line.strip()[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"stdin line {lineno}: expected a JSON object, got {line[:80]!r}")
    unknown = set(obj) - {"value", "value_b64", "key", "event_time", "properties",
                          "publish_time", "sequence_id"}
    if unknown:
        raise ConfigError(f"stdin line {lineno}: unknown field(s) {sorted(unknown)}")
    seq = obj.get("sequence_id", lineno if numbered else None)
    if seq is not None:
        if not numbered:
            raise ConfigError(f"stdin line {lineno}: sequence_id is for a named producer: "
                              "give --name")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ConfigError(f"stdin line {lineno}: sequence_id must be an integer >= 0, "
                              f"got {seq!r}")
    if "value_b64" in obj and "value" in obj:
        raise ConfigError(f"stdin line {lineno}: give value or value_b64, not both (which one "
                          "is meant?)")
    if "value_b64" in obj:
        try:
            value = base64.b64decode(obj["value_b64"], validate=True)
        except (ValueError, TypeError):
            raise ConfigError(f"stdin line {lineno}: value_b64 is not base64") from None
    elif isinstance(obj.get("value"), str):
        value = obj["value"].encode()
    elif isinstance(obj.get("value"), (dict, list)):
        value = obj["value"]  # for a topic with a JSON or Avro schema: encoded by it
    else:
        raise ConfigError(f"stdin line {lineno}: needs a string 'value' (or 'value_b64', "
                          "or an object for a topic with a schema)")
    key = obj.get("key")
    if key is not None and not isinstance(key, str):
        raise ConfigError(f"stdin line {lineno}: key must be a string, got {key!r}")
    props = obj.get("properties")
    if props is not None and not (isinstance(props, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in props.items())):
        raise ConfigError(f"stdin line {lineno}: properties must map strings to strings")
    times = {}
    for f in ("event_time", "publish_time"):
        if obj.get(f) is not None:
            times[f] = parse_time_ms(obj[f], what=f"{f} on stdin line {lineno}")
    return {"value": value, "key": key, "properties": props, **times,
            **({"sequence_id": seq} if seq is not None else {})}


def _generated(n: int, keys: int, t0: int | None, step_ms: int, value_size: int, *,
               numbered: bool = False) -> Iterator[dict[str, Any]]:
    pages = ["/", "/search", "/product", "/cart", "/checkout", "/help"]
    pad = "x" * max(0, value_size - 60)
    for i in range(n):
        t = None if t0 is None else t0 + i * step_ms
        user = f"user-{(i * 7919) % keys:05d}"
        value = json.dumps({"user": user, "page": pages[i % len(pages)], "n": i, "pad": pad})
        yield {"value": value.encode(), "key": user, "publish_time": t, "event_time": t,
               "properties": {"source": "generator"},
               **({"sequence_id": i} if numbered else {})}


def _chunked(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in it:
        chunk.append(item)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
