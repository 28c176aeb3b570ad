"""The client side of a transaction: stage rows to any partitions of any topics, then commit
them all at once, or abort. ``broker/transactions/coordinator.py`` is the broker side and says
why a commit is atomic and crash-safe.

::

    with Transaction(broker=url) as txn:           # commit on success, abort on an error
        txn.write("acme/web/clicks", table)        # routed by key hash, as producers do
        txn.send("acme/web/orders", b"...", key="k1")

A Spark sink stages one transaction per task attempt and commits the batch's transactions
together from the driver, with its sink id and batch id (``spark_adapter/sink.py``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from tierstream.client.admin import Admin
from tierstream.client.stream_io import StreamIO
from tierstream.errors import ConfigError, ConflictError, NotFoundError, UnavailableError
from tierstream.model import arguments
from tierstream.model.message_format import as_produce_batch, batches_of_about, key_hashes
from tierstream.model.names import TopicName, check_txn_id
from tierstream.wire.flight import decode, translate_errors

if TYPE_CHECKING:
    from tierstream.schemas.codec import Encoder

__all__ = ["Transaction"]

#: Rows per staged Flight message are capped near this many bytes.
_CHUNK_BYTES = 8 * 1024**2
#: Rows staged to one partition are sent once about this many bytes are gathered (each
#: message is an entry on the broker: python -m bench sink)
_GATHER_BYTES = 1024**2


class Transaction:
    """One transaction. Rows written here are staged on the broker, invisible to every
    reader, until :meth:`commit` makes all of them visible at once; :meth:`abort` (or the
    broker's transaction timeout) discards them.

    ``sink``/``batch`` make the commit idempotent: the broker commits a sink's batch once,
    and a later commit of the same or an earlier batch id is a no-op that aborts this one.

    On a topic with a schema, values are encoded and checked as a producer's are (by the
    topic's latest version, or by the one ``encoders`` names for the topic), and the broker
    refuses rows whose version property names no version of the topic.
    """

    def __init__(self, *, broker: str | None = None, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None, sink: str | None = None,
                 batch: int | None = None, txn_id: str | None = None,
                 encoders: Mapping[str, Encoder] | None = None,
                 send_timeout: float = 30.0) -> None:
        if (sink is None) != (batch is None):
            raise ConfigError("a transaction names both a sink and a batch id, or neither")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                                  or batch < 0):
            raise ConfigError(f"invalid batch id {batch!r}: expected an integer >= 0")
        self.txn_id = uuid.uuid4().hex if txn_id is None else check_txn_id(
            arguments.text(txn_id, "txn_id"))
        #: how long a staging stream may take to take a batch or answer, as a producer's
        self.send_timeout = arguments.seconds(send_timeout, "send_timeout", zero_ok=False)
        self.sink = arguments.text(sink, "sink", none_ok=True)
        self.batch = batch
        self._admin = Admin(broker, auth_token=auth_token, tls_ca=tls_ca)
        self._partitions: dict[str, int] = {}
        # a topic's values are encoded by its latest schema, or by the version given here
        # (a producer's own, which it registered)
        self._encoders = _checked_encoders(encoders)
        # per (topic, partition, count routed by): a staging stream, and rows not sent yet
        self._streams: dict[tuple[str, int, int | None], StreamIO] = {}
        self._gathered: dict[tuple[str, int, int | None], list[pa.Table]] = {}
        self._gathered_bytes: dict[tuple[str, int, int | None], int] = {}
        self._sent: dict[tuple[str, int], int] = {}
        self._round_robin = 0
        self.state = "open"

    def __repr__(self) -> str:
        return (f"Transaction({self.txn_id}, {self.state}, sink={self.sink!r}, "
                f"batch={self.batch!r}, broker={self._admin.url!r})")

    # -- writing ------------------------------------------------------------------------------

    def partitions_of(self, topic: str) -> int:
        """``topic``'s partition count, looked up once; on several brokers (``--cluster``),
        with the owner of each partition, whose broker stages its rows (a partition that
        moves while it is staged to fails the transaction: abort it and write again)."""
        name = str(TopicName.parse(topic))
        if name not in self._partitions:
            self._partitions[name] = self._admin.get_topic(name).partitions
            self._admin.follow_owners(name)
        return self._partitions[name]

    def encoder(self, topic: str) -> Encoder | None:
        """The encoder of ``topic``'s latest schema (None: it has none), looked up once."""
        name = str(TopicName.parse(topic))
        if name not in self._encoders:
            from tierstream.schemas.codec import Encoder

            try:
                self._encoders[name] = Encoder(self._admin.get_schema(name))
            except NotFoundError:
                self.partitions_of(name)  # a missing topic says so, not "no schema"
                self._encoders[name] = None
        return self._encoders[name]

    def send(self, topic: str, value: Any, *, key: str | None = None,
             event_time: int | None = None, properties: Mapping[str, str] | None = None) -> None:
        """Stage one message (better: :meth:`write` many at once). On a topic with a schema,
        ``value`` is what the schema encodes (a dict for AVRO and JSON, text for STRING)."""
        self._check_open()
        name = str(TopicName.parse(topic))
        encoder = self.encoder(name)
        props = dict(properties) if properties is not None else None
        if encoder is not None:
            value = encoder.encode(value, self.messages)
            props = {**(props or {}), **encoder.properties}
        elif isinstance(value, str):
            value = value.encode()
        elif not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"topic {name!r} has no schema: a value is bytes or text, not "
                              f"{type(value).__name__} (tierstream schema set)")
        self._write(name, pa.Table.from_pydict({
            "key": pa.array([key], pa.string()), "value": pa.array([bytes(value)], pa.binary()),
            "event_time": pa.array([event_time], pa.int64()),
            "properties": pa.array([None if props is None else list(props.items())],
                                   pa.map_(pa.string(), pa.string()))}), None)

    def write(self, topic: str, data: pa.RecordBatch | pa.Table, *,
              partition: int | None = None, routed: int | None = None) -> int:
        """Stage rows (columns of the produce schema: ``value``, optional ``key``,
        ``event_time``, ``properties``) to ``topic``: routed by key hash like a producer's
        (unkeyed rows round-robin), or all to ``partition`` (``routed``: the partition count
        the caller routed them by, if it did). Rows routed by a count the topic no longer
        has at the commit (it grew at a scale event) are routed again by the new one.
        Returns the rows staged.

        On a topic with a schema, every value is encoded and checked by its latest version
        before any row is staged (``value`` may then be a struct, as the Spark sink sends
        it), and each row records that version, as producers do; ConfigError names the row
        and the field."""
        self._check_open()
        name = str(TopicName.parse(topic))
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        if table.num_rows == 0:
            return 0
        return self._write(name, self._encoded(name, table), partition, routed)

    def _write(self, name: str, table: pa.Table, partition: int | None,
               routed: int | None = None) -> int:
        """Stage ``table`` (values encoded already) to ``name``, routed or to ``partition``."""
        n = self.partitions_of(name)
        if partition is not None:
            if not 0 <= partition < max(n, routed or 0):
                raise ConfigError(f"invalid partition {partition} for {name!r}: it has "
                                  f"0..{n - 1}")
            self._stage(name, partition, table, routed)
            return int(table.num_rows)
        for p, part in self._route(table, n):
            self._stage(name, p, part, n)
        return int(table.num_rows)

    def _encoded(self, topic: str, table: pa.Table) -> pa.Table:
        """``table`` with its values encoded by the topic's schema, if it has one."""
        value = table.column("value")
        encoder = self.encoder(topic)
        if encoder is None:
            if pa.types.is_struct(value.type):
                raise ConfigError(f"column 'value' is a struct, but topic {topic!r} has no "
                                  "schema to encode it with (tierstream schema set)")
            if pa.types.is_string(value.type) or pa.types.is_large_string(value.type):
                return table.set_column(table.schema.get_field_index("value"), "value",
                                        value.cast(pa.binary()))
            return table
        props = table.column("properties") if "properties" in table.column_names else None
        encoded, merged = encoder.encode_columns(
            value.combine_chunks(), None if props is None else props.combine_chunks(),
            self.messages)
        out = table.set_column(table.schema.get_field_index("value"), "value", encoded)
        if props is None:
            return out.append_column("properties", merged)
        return out.set_column(out.schema.get_field_index("properties"), "properties", merged)

    def _route(self, table: pa.Table, partitions: int) -> list[tuple[int, pa.Table]]:
        if partitions == 1:
            return [(0, table)]
        keys = table.column("key") if "key" in table.column_names else \
            pa.nulls(table.num_rows, pa.string())
        target = np.asarray(key_hashes(keys.combine_chunks() if isinstance(
            keys, pa.ChunkedArray) else keys)) % partitions
        unkeyed = np.asarray(keys.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        if unkeyed.any():
            spread = (self._round_robin + np.arange(int(unkeyed.sum()))) % partitions
            self._round_robin += int(unkeyed.sum())
            target[unkeyed] = spread
        order = np.argsort(target, kind="stable")  # keeps each key's rows in order
        bounds = np.searchsorted(target[order], np.arange(partitions + 1))
        sorted_table = table.take(pa.array(order))
        return [(p, sorted_table.slice(bounds[p], bounds[p + 1] - bounds[p]))
                for p in range(partitions) if bounds[p + 1] > bounds[p]]

    def _stage(self, topic: str, partition: int, table: pa.Table, routed: int | None) -> None:
        """Stage ``table`` to one partition: gathered here up to :data:`_GATHER_BYTES` and
        then sent on the partition's staging stream, so that a writer handing over small
        batches (a Spark task's, split by partition) makes entries of a useful size."""
        key = (topic, partition, routed)
        if key not in self._streams:  # opened at once: the broker knows the transaction
            self._open_stream(key)
        self._gathered.setdefault(key, []).append(table)
        self._gathered_bytes[key] = self._gathered_bytes.get(key, 0) + table.nbytes
        self._sent[(topic, partition)] = self._sent.get((topic, partition), 0) + table.num_rows
        if self._gathered_bytes[key] >= _GATHER_BYTES:
            self._send(key)

    def _open_stream(self, key: tuple[str, int, int | None]) -> StreamIO:
        topic, partition, routed = key
        stream = self._streams[key] = StreamIO(self._admin, {
            "op": "stage", "txn": self.txn_id, "topic": topic, "partition": partition,
            "sink": self.sink, "batch": self.batch, "routed": routed})
        return stream

    def _send(self, key: tuple[str, int, int | None]) -> None:
        """Send what is gathered for one partition on its staging stream."""
        tables = self._gathered.pop(key, [])
        self._gathered_bytes.pop(key, None)
        if not tables:
            return
        topic, partition, _ = key
        table = pa.concat_tables(tables)
        stream = self._streams.get(key) or self._open_stream(key)
        try:
            with translate_errors(self._admin.url):
                for batch in batches_of_about(table, _CHUNK_BYTES):
                    stream.write(as_produce_batch(batch), None, self.send_timeout)
        except (flight.FlightError, OSError, pa.ArrowException) as exc:
            self.state = "failed"
            raise UnavailableError(f"staging transaction {self.txn_id} on {topic} partition "
                                   f"{partition} failed: {exc}; abort it and write "
                                   "again") from None
        except Exception:
            self.state = "failed"
            raise

    def flush(self) -> None:
        """Send the rows gathered so far to the broker (they are sent by themselves once a
        partition has enough, and at :meth:`prepare`): staged, still invisible."""
        self._check_open()
        for key in list(self._gathered):
            self._send(key)

    # -- ending -------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Finish staging: every staged row is durable on the broker, checked against what
        was sent. Spark tasks end here; the driver commits."""
        if self.state == "prepared":
            return {"txn": self.txn_id}
        self._check_open()
        try:
            for key in list(self._gathered):
                self._send(key)
            for key, stream in sorted(self._streams.items(),
                                      key=lambda kv: (*kv[0][:2], kv[0][2] or 0)):
                with translate_errors(self._admin.url):
                    stream.done_writing(self.send_timeout)
                    ack = stream.read(self.send_timeout)
                    stream.close(self.send_timeout)
                if ack is None:
                    raise UnavailableError(f"the broker closed transaction {self.txn_id}'s "
                                           f"staging stream for {key[0]} partition {key[1]}")
                decode(ack.to_pybytes(), "stage ack")
            self._streams.clear()
            self._admin.action("txn-prepare", {
                "txn": self.txn_id, "parts": [[t, p, n] for (t, p), n in self._sent.items()]})
        except BaseException:
            self.state = "failed"
            raise
        self.state = "prepared"
        return {"txn": self.txn_id, "parts": [[t, p, n] for (t, p), n in self._sent.items()]}

    @property
    def messages(self) -> int:
        return sum(self._sent.values())

    def commit(self) -> dict[str, Any]:
        """Prepare if needed, then make the transaction visible (one atomic step)."""
        if not self._sent:  # nothing staged: nothing to show, but a sink's batch is recorded
            self.state = "prepared"
            if self.sink is None:
                self.state = "committed"
                return {"status": "committed", "messages": 0}
            return self._commit([])
        self.prepare()
        return self._commit([self.txn_id])

    def _commit(self, txns: list[str]) -> dict[str, Any]:
        result = self._admin.commit_transactions(txns, sink=self.sink, batch=self.batch)
        self.state = "committed" if result.get("status") == "committed" else "aborted"
        return result

    def abort(self, reason: str = "aborted by its writer") -> None:
        """Discard everything staged. Safe to call in any state but committed."""
        if self.state in ("committed", "aborted"):
            if self.state == "committed":
                raise ConflictError(f"transaction {self.txn_id} is committed: it cannot be "
                                    "aborted")
            return
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.close(self.send_timeout)
        self._streams.clear()
        self._gathered.clear()
        self._gathered_bytes.clear()
        if self._sent or self.state == "failed":
            self._admin.abort_transaction(self.txn_id, reason)
        self.state = "aborted"

    def close(self) -> None:
        self._admin.close()

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        try:
            if exc_type is None:
                self.commit()
            else:
                with contextlib.suppress(Exception):  # the original error is what matters
                    self.abort(f"the writer failed: {_describe(exc_type, exc)}")
        finally:
            self.close()

    def _check_open(self) -> None:
        if self.state != "open":
            raise ConflictError(f"transaction {self.txn_id} is {self.state}: it takes no more "
                                "writes")


def _describe(exc_type: type[BaseException], exc: BaseException | None) -> str:
    """An error as a reason a person reads in ``tierstream transactions``: its class name
    and first line (``ValueError: bad row``), not ``<class 'ValueError'>``."""
    text = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
    return f"{exc_type.__name__}: {text[:200]}" if text else exc_type.__name__


def _checked_encoders(encoders: Any) -> dict[str, Encoder | None]:
    """``encoders`` by topic name (a producer passes its own)."""
    if encoders is not None and not isinstance(encoders, Mapping):
        raise ConfigError(f"invalid encoders {encoders!r:.60}: expected a mapping of topic "
                          "names to schema encoders")
    try:
        return {str(TopicName.parse(t)): e for t, e in (encoders or {}).items()}
    except ConfigError as exc:
        raise ConfigError(f"invalid encoders: {exc}") from None
