"""The sink: ``df.write.format("tierstream")`` and ``df.writeStream.format("tierstream")``,
exactly once through two-phase commit (broker/transactions/coordinator.py).

Each task attempt stages its rows as one transaction that no reader sees and returns its id;
the driver commits the batch's transactions in one step, idempotent by (sink id, batch id):

- a commit repeated after a driver restart, or a batch id at or below the sink's last
  committed one (Spark re-runs the last batch when the driver died before writing its commit
  log), is a no-op and the re-run's staged rows are aborted;
- transactions of failed or speculative task attempts that are not in the commit are
  aborted (fenced), never shown; staged rows nobody commits are removed by the broker's
  transaction timeout.

The sink id of a stream is its query's id, which Spark keeps in the checkpoint (tasks see it
as the local property ``sql.streaming.queryId``), or the option ``sinkId``. A batch write is
its own sink with one batch, or with ``sinkId``/``batchId`` an idempotent one (re-running the
job writes nothing twice).

Columns, like Spark's Kafka sink: ``value`` (binary or string, required), ``key`` (string),
``properties`` (map<string,string>), ``event_time`` (timestamp, or long ms), and ``topic``
(string) when the option ``topic`` is not given. Rows go to partitions by key hash, as the
producers route them. Anything else fails when the write starts, naming the column.

A topic with a schema (``tierstream schema set``) gets values encoded and checked against
its latest version: ``value`` may then be a struct (AVRO, JSON) or the encoded bytes; a value
that does not fit fails the task, naming the field, before its transaction is prepared.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from tierstream.errors import ConfigError
from tierstream.model.names import TopicName
from tierstream.options import parse_options, topic_from_path
from tierstream.util.faults import crash_point

__all__ = ["SinkOptions", "TierstreamBatchWriter", "TierstreamStreamWriter", "TxnMessage",
           "check_sink_schema", "check_sink_topic"]

#: Spark's local property with a streaming query's id (stable across restarts).
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"

_TYPES = {
    "value": ("binary", "string"),
    "key": ("string",),
    "properties": ("map<string,string>",),
    "event_time": ("timestamp", "timestamp_ntz", "bigint"),
    "topic": ("string",),
}


@dataclass(frozen=True, kw_only=True)
class SinkOptions:
    """The sink's options, parsed once on the driver (scope ``write`` of options.py)."""

    topic: str | None
    broker: str
    auth_token: str | None
    tls_ca: bytes | None
    sink_id: str | None
    batch_id: int | None

    @classmethod
    def parse(cls, raw: dict[str, str]) -> SinkOptions:
        from tierstream.wire.security import read_pem

        opts = parse_options(raw, scope="write")
        topic = topic_from_path(opts)  # df.write.format("tierstream").save("a/b/c")
        if topic is not None:
            topic = str(TopicName.parse(topic))
        if opts["batchId"] is not None and opts["sinkId"] is None:
            raise ConfigError("option 'batchId' needs option 'sinkId' (the writer it numbers)")
        return cls(topic=topic, broker=opts["broker"], auth_token=opts["authToken"],
                   tls_ca=read_pem(opts["tlsCa"], "tlsCa"), sink_id=opts["sinkId"],
                   batch_id=opts["batchId"])

    def admin(self) -> Any:
        """An admin client of the sink's broker (close it: ``with options.admin() as a:``)."""
        from tierstream.client.admin import Admin

        return Admin(self.broker, auth_token=self.auth_token, tls_ca=self.tls_ca)

    def __repr__(self) -> str:  # never the token
        return (f"SinkOptions(topic={self.topic!r}, broker={self.broker!r}, "
                f"sink_id={self.sink_id!r}, batch_id={self.batch_id!r})")


def check_sink_schema(schema: Any, options: SinkOptions) -> None:
    """Refuse, before anything is written, a column the sink does not know or of the wrong
    type; a missing ``value``; no topic at all."""
    fields = {f.name: f.dataType.simpleString() for f in schema.fields}
    for name, type_ in fields.items():
        if name not in _TYPES:
            raise ConfigError(f"the tierstream sink has no column {name!r}: expected "
                              f"{', '.join(_TYPES)} (select or rename the columns to write)")
        if name == "value" and type_.startswith("struct<"):
            continue  # encoded by the topic's schema in the task (AVRO or JSON)
        if type_ not in _TYPES[name]:
            raise ConfigError(f"column {name!r} is {type_}; the tierstream sink takes "
                              f"{' or '.join(_TYPES[name])}")
    if "value" not in fields:
        raise ConfigError("the tierstream sink needs a 'value' column (binary or string)")
    if options.topic is None and "topic" not in fields:
        raise ConfigError("the tierstream sink needs option 'topic' or a 'topic' column")


def check_sink_topic(schema: Any, options: SinkOptions) -> None:
    """On the driver, when the write starts: option ``topic`` names a topic that exists, and
    a struct ``value`` has a schema to be encoded with. Raises NotFoundError or ConfigError
    (one line, before any task runs)."""
    if options.topic is None:
        return  # topics come from the rows' 'topic' column: checked per row by the tasks
    from tierstream.errors import NotFoundError

    with options.admin() as admin:
        admin.get_topic(options.topic)
        struct = any(f.name == "value" and f.dataType.simpleString().startswith("struct<")
                     for f in schema.fields)
        if struct:
            try:
                admin.get_schema(options.topic)
            except NotFoundError:
                raise ConfigError(f"column 'value' is a struct, but topic {options.topic!r} "
                                  "has no schema to encode it with (tierstream schema set)"
                                  ) from None


@dataclass
class TxnMessage(WriterCommitMessage):
    """What a task attempt hands the driver: its transaction, if it staged rows."""

    txn_id: str | None
    sink_id: str | None
    rows: int


def _produce_columns(batch: pa.RecordBatch) -> pa.Table:
    """Spark's Arrow batch as the produce schema's columns (event_time in ms); values stay as
    Spark sent them: the transaction encodes them by the topic's schema, if it has one."""
    names = batch.schema.names
    value = batch.column("value")
    if value.null_count:
        raise ConfigError(f"column 'value' is null in {value.null_count} row(s): every "
                          "message needs a value")
    columns: dict[str, Any] = {"value": value}
    for name in ("key", "properties"):
        if name in names:
            columns[name] = batch.column(name)
    if "event_time" in names:
        t = batch.column("event_time")
        if pa.types.is_timestamp(t.type):
            # event times are ms: sub-millisecond digits are cut, as Kafka's sink does
            t = pc.cast(pc.cast(t, pa.timestamp("ms", tz=t.type.tz), safe=False), pa.int64())
        columns["event_time"] = t
    return pa.table(columns)


def write_task(options: SinkOptions, batches: Iterator[pa.RecordBatch], sink_id: str | None,
               batch_id: int | None) -> TxnMessage:
    """Executor: stage this task's rows as one transaction (prepared: durable, invisible)."""
    from tierstream.client.transaction import Transaction

    txn = Transaction(broker=options.broker, auth_token=options.auth_token,
                      tls_ca=options.tls_ca, sink=sink_id, batch=batch_id)
    try:
        rows = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if options.topic is not None:
                rows += txn.write(options.topic, _produce_columns(batch))
                continue
            topics = batch.column("topic")
            if topics.null_count:
                raise ConfigError(f"column 'topic' is null in {topics.null_count} row(s) and "
                                  "there is no option 'topic' to fall back on")
            for topic in pc.unique(topics).to_pylist():
                part = batch.filter(pc.equal(topics, topic))
                rows += txn.write(topic, _produce_columns(part))
        if rows == 0:
            return TxnMessage(txn_id=None, sink_id=sink_id, rows=0)
        txn.prepare()
        return TxnMessage(txn_id=txn.txn_id, sink_id=sink_id, rows=rows)
    except BaseException:
        txn.abort("the Spark task failed")
        raise
    finally:
        txn.close()


def commit_batch(options: SinkOptions, messages: list[Any], sink_id: str | None,
                 batch_id: int) -> dict[str, Any] | None:
    """Driver: commit the batch's transactions at once (idempotent by sink and batch)."""
    from tierstream.client.retry import reconnect_timeout_s, with_reconnect

    txns = _txn_ids(messages)
    if sink_id is None:
        sink_id = next((m.sink_id for m in messages if isinstance(m, TxnMessage)
                        and m.sink_id), None)
    if sink_id is None and not txns:
        return None  # nothing staged, no sink to record the batch for

    def commit() -> dict[str, Any]:
        with options.admin() as admin:
            result: dict[str, Any] = admin.commit_transactions(txns, sink=sink_id,
                                                               batch=batch_id)
            return result

    result = with_reconnect(commit, timeout_s=reconnect_timeout_s(),
                            what=f"committing batch {batch_id} of sink {sink_id!r}")
    crash_point("sink.committed")
    return result


def abort_batch(options: SinkOptions, messages: list[Any]) -> None:
    """Driver: a batch failed; abort what its tasks staged (the rest times out, or is fenced
    by the batch's next commit)."""
    txns = _txn_ids(messages)
    if not txns:
        return
    with options.admin() as admin:
        for txn in txns:
            try:
                admin.abort_transaction(txn, "the Spark job was aborted")
            except Exception:  # best effort: the timeout removes it otherwise
                continue


def _txn_ids(messages: list[Any]) -> list[str]:
    """The transactions the tasks of a batch staged (tasks that staged nothing have none)."""
    return [m.txn_id for m in messages if isinstance(m, TxnMessage) and m.txn_id]


class TierstreamBatchWriter(DataSourceArrowWriter):
    """``df.write.format("tierstream")``: one commit for the whole job."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options
        # made on the driver, pickled to the tasks: every task of this job stages under it
        self.sink_id = options.sink_id or f"write-{uuid.uuid4().hex}"
        self.batch_id = options.batch_id if options.batch_id is not None else 0

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TxnMessage:
        return write_task(self.options, iterator, self.sink_id, self.batch_id)

    def commit(self, messages: list[Any]) -> None:
        commit_batch(self.options, messages, self.sink_id, self.batch_id)

    def abort(self, messages: list[Any]) -> None:
        abort_batch(self.options, messages)


class TierstreamStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("tierstream")``: one commit per micro-batch."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TxnMessage:
        from pyspark import TaskContext

        context = TaskContext.get()
        sink_id = self.options.sink_id
        batch = None
        if context is not None:
            sink_id = sink_id or context.getLocalProperty(QUERY_ID_PROPERTY)
            raw = context.getLocalProperty(BATCH_ID_PROPERTY)
            batch = None if raw is None else int(raw)
        if sink_id is None or batch is None:
            raise ConfigError("the tierstream sink could not learn the streaming query's id "
                              "and batch id from Spark; set option 'sinkId'")
        return write_task(self.options, iterator, sink_id, batch)

    def commit(self, messages: list[Any], batchId: int) -> None:
        commit_batch(self.options, messages, self.options.sink_id, batchId)

    def abort(self, messages: list[Any], batchId: int) -> None:
        abort_batch(self.options, messages)
