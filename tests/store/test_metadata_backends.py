"""The metadata store on both backends, SQLite (the embedded default) and PostgreSQL: the same
operations give the same answers; and what can go wrong with a PostgreSQL URL is one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tierstream.client import Admin, Consumer, Producer, read
from tierstream.errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    NotFoundError,
    UnavailableError,
)
from tierstream.metadata.records import SegmentState
from tierstream.metadata.schema_registry import SchemaRegistry
from tierstream.metadata.store import MetadataStore
from tierstream.metadata.tables import SCHEMA_VERSION
from tierstream.metadata.transaction_records import TransactionRecords
from tierstream.model.names import TopicName
from tierstream.model.positions import Offset
from tierstream.schemas.model import SchemaType
from tierstream.util.faults import FAULT_ENV

from ..postgres import PostgresServer, started
from ..timing import scaled
from .helpers import stop_process, wait_for


def test_topics_segments_windows_and_deletions_read_back_alike(
        metadata_store: MetadataStore) -> None:
    store = metadata_store
    topic, created = store.create_topic(TopicName.parse("acme/web/clicks"), 3, created_at=5,
                                        ensembles=[("bookie-0",)] * 3)
    assert topic.partitions == 3 and [s.partition for s in created] == [0, 1, 2]
    assert len({s.segment_id for s in created}) == 3
    with pytest.raises(AlreadyExistsError):
        store.create_topic(TopicName.parse("acme/web/clicks"), 1, created_at=6, ensembles=[()])
    store.create_topic(TopicName.parse("acme/web_x/other"), 1, created_at=7,
                       ensembles=[("bookie-0",)])
    assert [t.name for t in store.list_topics("acme/web")] == ["acme/web/clicks"]
    first = created[0]
    sealed = first.with_stats(state=SegmentState.CLOSED, entries=4, messages=40, bytes=400,
                              min_publish_time=100, max_publish_time=200, sealed_at=210,
                              skipped=((1, 2),))
    store.seal_segment(sealed, {"writer": (7, {"at": [1, 2]})},
                       {"txn-1": [[3, 10, None]]})
    later = store.new_segment("acme/web/clicks", 0, ensemble=("bookie-0",), created_at=220)
    assert later.segment_id > first.segment_id
    store.update_segment_stats(later.with_stats(entries=1, messages=1, bytes=10,
                                                min_publish_time=300, max_publish_time=300))
    windows = store.segments_in_windows("acme/web/clicks", [0, 1], 150, 250)
    assert [s.segment_id for s in windows[0]] == [first.segment_id]
    assert windows[0][0].skipped == ((1, 2),)
    assert [s.segment_id for s in windows[1]] == [created[1].segment_id]  # open, no time yet
    everything = store.segments_in_windows("acme/web/clicks", [0], None, None)[0]
    assert [s.segment_id for s in everything] == [first.segment_id, later.segment_id]
    assert store.load_dedup("acme/web/clicks", 0) == {"writer": (7, {"at": [1, 2]})}
    store.record_deletion(sealed, deleted_at=500, reason="retention")
    store.record_deletion(sealed, deleted_at=501, reason="retention again")  # upsert
    (gone,) = store.deleted_segments("acme/web/clicks")
    assert (gone["segment_id"], gone["deleted_at"], gone["reason"]) == (
        first.segment_id, 501, "retention again")
    assert store.first_segment_id("acme/web/clicks", 0) == later.segment_id
    with pytest.raises(NotFoundError):
        store.get_segment(first.segment_id)


def test_cursors_transactions_schemas_and_scale_events_read_back_alike(
        metadata_store: MetadataStore) -> None:
    store = metadata_store
    from tierstream.metadata.scale_events import record_scale_event

    store.create_topic(TopicName.parse("a/b/c"), 2, created_at=1, ensembles=[("b",)] * 2)
    store.save_cursors([("a/b/c", "s", 0, {"mark": [1, 2, 3]}),
                        ("a/b/c", "s", 1, {"mark": [4]})], now=10)
    store.save_cursors([("a/b/c", "s", 0, {"mark": [9]})], now=11)
    assert store.get_cursor("a/b/c", "s", 0) == {"mark": [9]}
    assert [(r["partition"], r["updated_at"]) for r in store.cursors("a/b/c")] == [(0, 11),
                                                                                  (1, 10)]
    assert store.delete_cursors("a/b/c", "s") == 2 and store.cursors("a/b/c") == []
    records = TransactionRecords(store)
    records.begin("t1", "sink", 0, 5)
    records.begin("t1", "sink", 0, 6)  # idempotent
    assert records.get("t1").state == "OPEN"
    registry = SchemaRegistry(store)
    v1 = registry.register("a/b/c", SchemaType.STRING, None)
    assert v1.version == 1 and registry.register("a/b/c", SchemaType.STRING, None) == v1
    grown, opened = record_scale_event(store, "a/b/c", 2, 4, at=20, reason="test",
                                       ensembles=[("b",)] * 4)
    assert grown.partitions == 4 and len(opened) == 4
    assert [e.new for e in store.get_topic("a/b/c").scale_events] == [4]


def test_a_store_of_an_older_version_is_migrated_when_a_broker_opens_it(
        metadata_store: MetadataStore) -> None:
    """Version 9 had no ``segments.skipped``: opened to write, the store gains the column and
    says version 10, on either engine (the same migration, through ``Backend.columns``)."""
    store = metadata_store
    where = store.backend.name if store.backend.dialect == "sqlite" else store.backend.url
    store.create_topic(TopicName.parse("a/b/old"), 1, created_at=1, ensembles=[("b",)])
    with store.atomic() as c:
        c.execute("ALTER TABLE segments DROP COLUMN skipped")
        c.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
    store.close()
    with pytest.raises(ConfigError, match=r"has schema version 9; .* upgrades it"):
        MetadataStore(where, read_only=True)
    upgraded = MetadataStore(where)
    try:
        assert "skipped" in upgraded.backend.columns("segments")
        assert upgraded.query("SELECT value FROM meta WHERE key='schema_version'") == [
            (str(SCHEMA_VERSION),)]
        assert [s.skipped for s in upgraded.segments("a/b/old")] == [()]
    finally:
        upgraded.close()


def test_a_postgresql_url_that_cannot_serve_is_one_clear_error(postgres: PostgresServer,
                                                               free_port: int) -> None:
    with pytest.raises(UnavailableError, match=rf"cannot connect to the metadata store "
                                               rf"postgresql://postgres@127.0.0.1:{free_port}"):
        MetadataStore(postgres.url().replace(str(postgres.port), str(free_port)))
    bad_password = postgres.url(user="secured:wrong")
    with pytest.raises(UnavailableError, match="password authentication failed") as info:
        MetadataStore(bad_password)
    assert "wrong" not in str(info.value)  # the password is not repeated
    with pytest.raises(UnavailableError, match='database "nothere" does not exist'):
        MetadataStore(postgres.url("nothere"))
    url = postgres.new_database()
    MetadataStore(url).close()
    postgres.sql(url, "UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(ConfigError, match=r"version 99; .* written by a newer tierstream"):
        MetadataStore(url)
    postgres.sql(url, f"UPDATE meta SET value='{SCHEMA_VERSION}' WHERE key='schema_version'")
    holder = MetadataStore(url)
    try:
        with pytest.raises(ConflictError, match="held by another running broker"):
            MetadataStore(url)
        MetadataStore(url, read_only=True).close()  # readers are welcome
    finally:
        holder.close()
    MetadataStore(url).close()  # free again once the first let go


def _lock_holder(url: str) -> int | None:
    """The server pid of the session holding a broker's advisory lock on ``url``, if any."""
    import psycopg

    from tierstream.metadata.leader_lease import LOCK_KEY

    with psycopg.connect(url, autocommit=True, connect_timeout=int(scaled(30))) as conn:
        row = conn.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s "
                           "AND granted AND database = (SELECT oid FROM pg_database WHERE "
                           "datname = current_database())", (LOCK_KEY & 0xFFFF_FFFF,)).fetchone()
    return None if row is None else int(row[0])


@contextlib.contextmanager
def _closing_while_its_lock_session_is_stopped(url: str
                                              ) -> Iterator[tuple[threading.Thread, int]]:
    """A store on ``url`` closing (a thread) while the server process of its lock's session
    is stopped, and that process's pid; the process is continued on leaving."""
    holder = MetadataStore(url)
    pid = _lock_holder(url)
    assert pid is not None
    stop_process(pid)
    closing = threading.Thread(target=holder.close)
    try:
        closing.start()
        yield closing, pid
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_closed_store_has_freed_its_lock_by_the_time_close_returns(
        postgres: PostgresServer) -> None:
    """The server ends a closed session in its own time: a broker started right after another
    stopped (a restart) once found the lock still held (CI, in the test above). ``close``
    frees it on its session first. Here the server is slow to end that session (its process
    stopped): close may not return with the lock still held."""
    url = postgres.new_database()
    with _closing_while_its_lock_session_is_stopped(url) as (closing, pid):
        closing.join(scaled(0.5))  # the old close returned at once, the lock still held
        returned_while_held = not closing.is_alive() and _lock_holder(url) == pid
    closing.join(scaled(30))
    assert not returned_while_held, "close() returned while its session still held the lock"
    assert not closing.is_alive()
    assert _lock_holder(url) is None
    MetadataStore(url).close()


def test_a_store_whose_server_does_not_answer_still_closes(postgres: PostgresServer,
                                                           monkeypatch) -> None:
    """Freeing the lock waits a bounded time (a broker stopping during an outage must stop);
    the server frees it once it sees the session end."""
    from tierstream.metadata import leader_lease

    monkeypatch.setattr(leader_lease, "UNLOCK_WAIT_S", 0.2)
    url = postgres.new_database()
    with _closing_while_its_lock_session_is_stopped(url) as (closing, _):
        closing.join(scaled(15))
        assert not closing.is_alive(), "close() hung on a server that does not answer"
    wait_for(lambda: _lock_holder(url) is None, scaled(30), "the lock freed")
    MetadataStore(url).close()


def test_a_broker_on_postgresql_metadata_serves_survives_a_sigkill_and_refuses_a_second(
        postgres: PostgresServer, start_broker, tmp_path) -> None:
    url = postgres.new_database()
    broker = start_broker("--metadata", url)
    assert not (broker.data_dir / "metadata.db").exists()
    with Admin(broker.url) as admin:
        admin.create_topic("acme/pg/orders", 2)
    with Producer("acme/pg/orders", broker=broker.url, name="pg-writer") as producer:
        producer.send_many({"key": f"k{i % 7}", "value": f"{i}".encode()} for i in range(500))
    consumer = Consumer("acme/pg/orders", "audit", broker=broker.url, initial=Offset.earliest())
    got = 0
    while got < 200:
        batch = consumer.receive(timeout=scaled(30))
        assert batch is not None
        consumer.ack(batch)
        got += batch.num_rows
    broker.kill()
    # the killed broker's session, and with it its hold on the database, ended with it
    broker = start_broker("--metadata", url)
    values = [v for b in read("acme/pg/orders", broker=broker.url, end=Offset.latest())
              for v in b.column("value").to_pylist()]
    assert sorted(int(v) for v in values) == list(range(500))
    with Admin(broker.url) as admin:  # the acks were stored in PostgreSQL
        assert sum(r["backlog"] for r in admin.subscriptions("acme/pg/orders")) == 500 - got
    second = subprocess.run(
        [sys.executable, "-m", "tierstream", "broker", "start", "--data-dir",
         str(tmp_path / "second"), "--port", "0", "--pulsar-port", "0", "--admin-port", "0",
         "--metadata", url], capture_output=True, text=True, timeout=scaled(60))
    assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
    assert "held by another running broker" in second.stderr
    assert not (tmp_path / "second").exists()  # nothing half-created


def test_a_heartbeat_thread_that_fails_stops_the_broker_saying_why(
        postgres: PostgresServer, start_broker) -> None:
    """The lease's heartbeat thread dies of an error nobody foresaw (a fault point): a
    standby would take the store over unseen, so the broker gives the store up and stops,
    saying why, rather than write on until it is cut off."""
    broker = start_broker("--metadata", postgres.new_database(),
                          env={FAULT_ENV: "metadata.heartbeat@5"})
    assert broker.proc is not None
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None,
             timeout=scaled(60), what="the broker to stop")
    said = "".join(broker.stderr_tail)
    assert broker.proc.returncode == 1, said
    assert "metadata-heartbeat stopped by an unexpected error" in said  # with its stack
    assert "the heartbeat of the metadata store" in said and "the broker stops" in said


def test_bad_metadata_urls_are_one_line_naming_the_value(tmp_path, free_port) -> None:
    for url, code, needle in [
            ("mysql://db/x", 2, "invalid --metadata 'mysql://db/x'"),
            (f"postgresql://u@127.0.0.1:{free_port}/x", 1, "cannot connect to the metadata "
                                                             "store")]:
        done = subprocess.run(
            [sys.executable, "-m", "tierstream", "broker", "start", "--data-dir",
             str(tmp_path / "d"), "--port", "0", "--pulsar-port", "0", "--admin-port", "0"],
            capture_output=True, text=True, timeout=scaled(120),
            env={**__import__("os").environ, "TIERSTREAM_METADATA": url})
        assert done.returncode == code and done.stderr.count("\n") == 1, done.stderr
        assert needle in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "d").exists()


def test_postgresql_stopped_under_load_holds_acks_until_it_returns(start_broker) -> None:
    """PostgreSQL stopped while a producer and a consumer run: the broker keeps its process
    and its data, the acks that need a metadata write wait (a consumer's ack, a segment
    roll's), and everything resumes when the server is back: every message read back once.
    Past the outage limit, a broker stops cleanly with one line."""
    import threading

    server = started()  # its own: this test stops it
    try:
        url = server.new_database()
        broker = start_broker("--metadata", url, "--max-entries-per-segment", "20",
                              env={"TIERSTREAM_METADATA_OUTAGE_S": str(scaled(120))})
        topic = "acme/pg/outage"
        with Admin(broker.url) as admin:
            admin.create_topic(topic, 1)
        consumer = Consumer(topic, "c", broker=broker.url, initial=Offset.earliest())
        acked: list[int] = []
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                with Producer(topic, broker=broker.url, name="steady", batch_size=10,
                              send_timeout=scaled(180)) as producer:
                    producer.send_many({"value": f"{i}".encode()} for i in range(1000))
            except BaseException as exc:
                errors.append(exc)

        def consume() -> None:
            try:
                while len(acked) < 1000:
                    batch = consumer.receive(timeout=scaled(180))
                    if batch is None:
                        raise AssertionError(f"nothing to receive after {len(acked)}")
                    consumer.ack(batch)
                    acked.extend(int(v) for v in batch.column("value").to_pylist())
            except BaseException as exc:
                errors.append(exc)

        server.halt()
        threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
        for t in threads:
            t.start()
        # rolls and cursor commits wait for the server: the acks stop short of the end
        wait_for(lambda: broker.proc is not None and broker.proc.poll() is None
                 and len(acked) < 1000 and "unreachable" in "".join(broker.stderr_tail),
                 timeout=scaled(60), what="the broker to wait for PostgreSQL")
        held = len(acked)
        threads[1].join(timeout=2)
        assert len(acked) == held < 1000 and broker.proc.poll() is None
        server.resume()
        for t in threads:
            t.join(timeout=scaled(240))
        assert not errors, errors
        assert sorted(acked) == list(range(1000))
        values = [int(v) for b in read(topic, broker=broker.url, end=Offset.latest())
                  for v in b.column("value").to_pylist()]
        assert values == list(range(1000))  # once each, in order
        consumer.close()

        # past the limit: one line, a clean stop, and a restart recovers
        other = server.new_database()
        quick = start_broker("--metadata", other, data=broker.data_dir.parent / "quick",
                             env={"TIERSTREAM_METADATA_OUTAGE_S": str(scaled(2))})
        server.halt()
        with pytest.raises(Exception), Admin(quick.url) as admin:  # noqa: B017 - it gives up
            admin.create_topic("acme/pg/late", 1)
        assert quick.proc is not None
        assert quick.proc.wait(timeout=scaled(60)) == 1
        last = [line for line in quick.stderr_tail if line.strip()][-1]
        assert last.startswith("error: the metadata store") and "the broker stopped" in last
        assert "Traceback" not in "".join(quick.stderr_tail)
        server.resume()
        again = start_broker("--metadata", other, data=broker.data_dir.parent / "quick")
        with Admin(again.url) as admin:
            admin.create_topic("acme/pg/late", 1)
    finally:
        server.stop()


def test_appends_go_on_while_postgresql_is_down_between_segment_rolls(start_broker) -> None:
    """Regression: each housekeeping pass wrote an open segment's live stats to the metadata
    store holding the partition's lock. While PostgreSQL was down that write waited, up to
    the outage limit, and every append of the partition waited behind it: within a second
    of an outage every producer stalled, though an append needs no metadata between two
    segment rolls. The stats are now written outside the lock."""
    server = started()  # its own: this test stops it
    try:
        broker = start_broker("--metadata", server.new_database(), "--no-fsync",
                              env={"TIERSTREAM_METADATA_OUTAGE_S": str(scaled(120))})
        topic = "acme/pg/appends"
        with Admin(broker.url) as admin:
            admin.create_topic(topic, 1)
        acked = [0]
        stop = threading.Event()
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                with Producer(topic, broker=broker.url, name="steady", batch_size=10,
                              send_timeout=scaled(120)) as producer:
                    while not stop.is_set():
                        producer.send_many({"value": b"v"} for _ in range(10))
                        acked[0] += 10
            except BaseException as exc:
                errors.append(exc)

        writer = threading.Thread(target=produce)
        writer.start()
        try:
            wait_for(lambda: acked[0] >= 100, what="acks")
            server.halt()
            wait_for(lambda: any("metadata.postgres: " in line and "is unreachable" in line
                                 for line in broker.stderr_tail),
                     what="the broker to find PostgreSQL gone")
            for _ in range(3):  # several housekeeping passes meanwhile (one a second)
                more = acked[0] + 200
                wait_for(lambda more=more: acked[0] >= more or bool(errors),
                         timeout=scaled(10), what="acks while PostgreSQL is down")
                time.sleep(1.0)  # the next pass, not synchronisation
            assert not errors, errors
            server.resume()
        finally:
            stop.set()
            writer.join(timeout=scaled(120))
        assert not errors, errors
        values = read(topic, broker=broker.url, end=Offset.latest())
        assert sum(b.num_rows for b in values) == acked[0]
    finally:
        server.stop()


def test_clients_open_and_read_while_postgresql_is_down(start_broker) -> None:
    """Regression: opening a Producer asked the broker for the topic's schema and registered
    its own, both metadata reads, so a producer (re)started during an outage waited it out,
    though its appends need no metadata. The schema registry answers with the versions last
    read while the metadata store is unreachable (versions only grow, and a new one needs
    the store). A consumer of an existing subscription and a read work too."""
    import json

    schema = json.dumps({"type": "record", "name": "R", "fields": [
        {"name": "n", "type": "long"}]})
    server = started()  # its own: this test stops it
    try:
        broker = start_broker("--metadata", server.new_database(), "--no-fsync")
        topic = "acme/pg/clients"
        with Admin(broker.url) as admin:
            admin.create_topic(topic, 2)
        Consumer(topic, "audit", broker=broker.url, initial=Offset.earliest()).close()
        with Producer(topic, broker=broker.url, schema=("avro", schema)) as producer:
            producer.send_many({"key": f"k{i}", "value": {"n": i}} for i in range(10))
        server.halt()
        wait_for(lambda: any("metadata.postgres: " in line and "is unreachable" in line
                             for line in broker.stderr_tail),
                 what="the broker to find PostgreSQL gone")
        with Producer(topic, broker=broker.url, name="restarted", schema=("avro", schema),
                      send_timeout=scaled(30)) as producer:
            producer.send_many({"key": f"k{i}", "value": {"n": i}} for i in range(10, 20))
        got: list[str] = []
        with Consumer(topic, "audit", broker=broker.url) as consumer:
            while len(got) < 20:
                batch = consumer.receive(timeout=scaled(30))
                assert batch is not None, f"received {sorted(got)} of 20"
                got += batch.column("key").to_pylist()
        assert sorted(got) == sorted(f"k{i}" for i in range(20))
        rows = sum(b.num_rows for b in read(topic, broker=broker.url, end=Offset.latest()))
        assert rows == 20
        server.resume()
    finally:
        server.stop()


def test_processes_opening_a_new_database_at_once_create_its_tables_once(postgres) -> None:
    """Regression: three ``bookie serve`` started together on a new database raced creating
    its tables, and one exited with ``unexpected UniqueViolation`` (2 of 3 tries): creation
    is now serialised under an advisory lock."""
    for _ in range(3):
        url = postgres.new_database()
        opener = ("from tierstream.metadata.store import MetadataStore; "
                  f"MetadataStore({url!r}, hold=False).close()")
        procs = [subprocess.Popen([sys.executable, "-c", opener], stderr=subprocess.PIPE,
                                  text=True) for _ in range(4)]
        errors = [p.communicate(timeout=scaled(60))[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), errors


def test_a_broker_opening_a_postgresql_store_gives_its_planner_statistics(postgres,
                                                                         start_broker
                                                                         ) -> None:
    """Regression: without statistics (a store filled faster than autovacuum analyzes it)
    PostgreSQL planned the binary search over segments as scans, 11x slower than SQLite
    (``python -m bench metadata``); the broker now ANALYZEs the segments table when it opens
    the store."""
    import psycopg

    url = postgres.new_database()
    start_broker("--metadata", url)

    def analyzed() -> bool:
        with psycopg.connect(url, autocommit=True, connect_timeout=int(scaled(30))) as conn:
            row = conn.execute("SELECT last_analyze FROM pg_stat_user_tables WHERE "
                               "relname = 'segments'").fetchone()
        return row is not None and row[0] is not None

    wait_for(analyzed, what="the segments table analyzed")


class _Cursor:
    """What the cursor writer stores of a subscription's cursor (its Snapshotting)."""

    def __init__(self, value: int) -> None:
        self.topic, self.subscription, self.partition, self.value = "acme/pg/acks", "s", 0, value

    def snapshot(self) -> dict[str, int]:
        return {"acked": self.value}


def test_a_cursor_write_cut_short_by_the_server_is_written_again(postgres) -> None:
    """Regression (cluster chaos, PostgreSQL restarted): a cursor transaction whose session
    the server ended midway ('did not complete') ended the cursor writer's thread, and every
    later ack on that broker failed ('cannot store a cursor') until it restarted. The
    cursors are now written again; only a metadata store given up for good fails them."""
    import psycopg

    from tierstream.broker.subscriptions.cursor_writer import CursorWriter

    url = postgres.new_database()
    store = MetadataStore(url, hold=False)
    writer = CursorWriter(store)
    try:
        cursor = _Cursor(1)
        writer.wait(writer.dirty(cursor))
        with psycopg.connect(url, autocommit=True) as admin, \
                psycopg.connect(url) as blocker:
            # the next write waits on the row, inside its transaction ...
            blocker.execute("SELECT 1 FROM cursors FOR UPDATE")
            cursor.value = 2
            generation = writer.dirty(cursor)
            wait_for(lambda: bool(admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchall()),
                     timeout=scaled(30), what="the cursor write to wait on the row")
            # ... and the server ends its session there
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                          "wait_event_type = 'Lock'")
            blocker.rollback()
        writer.wait(generation)  # written again, not 'cannot store a cursor'
        cursor.value = 3
        writer.wait(writer.dirty(cursor))
        (state,) = store.backend.read("SELECT state FROM cursors")[0]
        assert json.loads(state) == {"acked": 3}
    finally:
        writer.close()
        store.close()
