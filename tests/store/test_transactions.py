"""Transactions: staged rows no reader sees, commits that show a batch at once and only once.

Real brokers on loopback: in this process (``tests/logs.py``) for the protocol, and as
processes killed at each ``txn.*`` crash point for crash safety.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import Counter

import pyarrow as pa
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer, Transaction, read
from tierstream.errors import ConfigError, ConflictError, NotFoundError
from tierstream.faults import ENV
from tierstream.splits.positions import Offset

from ..logs import running_log
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/txn/out"
OTHER = "acme/txn/other"


def _rows(prefix: str, n: int, keys: int = 7) -> pa.Table:
    return pa.table({"key": [f"k{i % keys}" for i in range(n)],
                     "value": [f"{prefix}-{i}".encode() for i in range(n)]})


def _values(table: pa.Table) -> list[str]:
    return [v.decode() for v in table.column("value").to_pylist()]


def test_staged_rows_are_invisible_until_commit_then_all_visible(tmp_path) -> None:
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 4)
            admin.create_topic(OTHER, 2)
        txn = Transaction(broker=log.url)
        txn.write(TOPIC, _rows("a", 500))
        txn.write(OTHER, _rows("b", 100))
        txn.prepare()
        # staged and prepared: durable on the broker, seen by no reader or planner
        assert read_all(log.url, TOPIC).num_rows == 0
        assert read_all(log.url, OTHER).num_rows == 0
        assert all(s.messages == 0 for s in log.store.segments(TOPIC))
        result = txn.commit()
        assert result["status"] == "committed" and result["messages"] == 600
        assert sorted(_values(read_all(log.url, TOPIC))) == sorted(
            _values(_rows("a", 500)))
        assert read_all(log.url, OTHER).num_rows == 100
        # routed by key hash as a producer routes: each key in one partition, in order
        table = read_all(log.url, TOPIC)
        by_key: dict[str, set[int]] = {}
        for k, p in zip(table.column("key").to_pylist(), table.column("partition").to_pylist(),
                        strict=True):
            by_key.setdefault(k, set()).add(p)
        assert all(len(ps) == 1 for ps in by_key.values())
        assert not (log.data_dir / "transactions" / txn.txn_id).exists()  # staging removed


def test_a_sink_batch_is_committed_once_and_other_attempts_are_fenced(tmp_path) -> None:
    with running_log(tmp_path / "data") as log, Admin(log.url) as admin:
        admin.create_topic(TOPIC, 2)
        # batch 0: two task attempts of one task; only the second is in the commit
        failed = Transaction(broker=log.url, sink="q1", batch=0)
        failed.write(TOPIC, _rows("zombie", 10))
        failed.prepare()
        ok = Transaction(broker=log.url, sink="q1", batch=0)
        ok.write(TOPIC, _rows("b0", 10))
        ok.prepare()
        result = admin.commit_transactions([ok.txn_id], sink="q1", batch=0)
        assert result["status"] == "committed" and result["aborted"] == [failed.txn_id]
        with pytest.raises(ConflictError, match="fenced"):
            admin.commit_transactions([failed.txn_id], sink="q1", batch=1)
        # the same commit again (a driver restarted after committing): a no-op
        again = admin.commit_transactions([ok.txn_id], sink="q1", batch=0)
        assert again["status"] == "already-committed"
        # the batch re-run after a restart stages new rows: they are aborted, not written
        rerun = Transaction(broker=log.url, sink="q1", batch=0)
        rerun.write(TOPIC, _rows("b0", 10))
        assert rerun.commit()["status"] == "already-committed"
        assert rerun.state == "aborted"
        assert admin.last_committed_batch("q1") == 0
        assert sorted(_values(read_all(log.url, TOPIC))) == sorted(_values(_rows("b0", 10)))
        states = {t["txn_id"]: t["state"] for t in admin.transactions()}
        assert states[failed.txn_id] == "ABORTED" and states[ok.txn_id] == "APPLIED"
        assert states[rerun.txn_id] == "ABORTED"


def test_a_re_run_s_commit_fences_every_other_attempt_of_the_committed_batch(tmp_path
                                                                             ) -> None:
    """Batch 5 committed; a second attempt of it staged (and prepared, another still open);
    a third attempt's commit is a no-op that must abort the others too, not leave them
    PREPARED until the transaction timeout."""
    with running_log(tmp_path / "data") as log, Admin(log.url) as admin:
        admin.create_topic(TOPIC, 2)
        first = Transaction(broker=log.url, sink="q5", batch=5)
        first.write(TOPIC, _rows("b5", 10))
        assert first.commit()["status"] == "committed"
        second = Transaction(broker=log.url, sink="q5", batch=5)
        second.write(TOPIC, _rows("again", 10))
        second.prepare()
        still_open = Transaction(broker=log.url, sink="q5", batch=5)
        still_open.write(TOPIC, _rows("open", 3))
        third = Transaction(broker=log.url, sink="q5", batch=5)
        third.write(TOPIC, _rows("third", 10))
        try:
            result = third.commit()
            # the attempt still staging finishes after the fence: refused, not kept
            with pytest.raises(ConflictError, match="aborted"):
                still_open.prepare()
        finally:  # its stream must not stay open (the broker's shutdown would wait on it)
            with contextlib.suppress(Exception):
                still_open.abort()
        assert result["status"] == "already-committed"
        assert sorted(result["aborted"]) == sorted([second.txn_id, still_open.txn_id,
                                                    third.txn_id])
        states = {t["txn_id"]: t["state"] for t in admin.transactions()}
        assert states[second.txn_id] == states[still_open.txn_id] == "ABORTED"
        assert states[third.txn_id] == "ABORTED" and states[first.txn_id] == "APPLIED"
        for txn in (second, still_open, third):  # staging removed with the fence
            assert not (log.data_dir / "transactions" / txn.txn_id).exists()
        assert sorted(_values(read_all(log.url, TOPIC))) == sorted(_values(_rows("b5", 10)))
        # an attempt of an older batch (4, below the last committed 5) is fenced the same way
        old = Transaction(broker=log.url, sink="q5", batch=4)
        old.write(TOPIC, _rows("b4", 2))
        old.prepare()
        admin.commit_transactions([], sink="q5", batch=4)
        assert {t["txn_id"]: t["state"] for t in admin.transactions()}[old.txn_id] == \
            "ABORTED"


def test_abort_and_timeout_discard_staged_rows(tmp_path) -> None:
    with running_log(tmp_path / "data", transactionTimeout="1s") as log, \
            Admin(log.url) as admin:
        admin.create_topic(TOPIC, 1)
        aborted = Transaction(broker=log.url)
        aborted.write(TOPIC, _rows("x", 5))
        aborted.abort()
        with pytest.raises(ConflictError, match="aborted"):
            admin.commit_transactions([aborted.txn_id])
        idle = Transaction(broker=log.url)
        idle.write(TOPIC, _rows("y", 5))
        idle.prepare()
        staging = log.data_dir / "transactions" / idle.txn_id
        assert staging.exists()
        log.store.transactions.expire(now=2**62)  # what housekeeping does after the timeout
        assert not staging.exists()
        with pytest.raises(ConflictError, match="timed out after 1 s"):
            admin.commit_transactions([idle.txn_id])
        assert read_all(log.url, TOPIC).num_rows == 0
        with pytest.raises(NotFoundError, match="no transaction"):
            admin.commit_transactions(["nope"])
        with pytest.raises(ConfigError, match="invalid transaction id"):
            admin.commit_transactions(["../etc"])


def test_python_producer_transactions_are_atomic(tmp_path) -> None:
    with running_log(tmp_path / "data") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 3)
        with Producer(TOPIC, broker=log.url, batch_size=10) as producer:
            producer.send(b"before")
            with producer.transaction():
                producer.send_many([{"value": f"t{i}".encode(), "key": f"k{i}"}
                                    for i in range(30)])
                assert read_all(log.url, TOPIC).num_rows == 1  # only "before"
            assert read_all(log.url, TOPIC).num_rows == 31
            with pytest.raises(RuntimeError), producer.transaction():
                producer.send(b"never")
                raise RuntimeError("the writer fails")
            producer.send(b"after")
        values = _values(read_all(log.url, TOPIC))
        assert "never" not in values and "after" in values and len(values) == 32
        with Admin(log.url) as admin:  # the reason reads as the error, not its class repr
            reasons = [t["reason"] for t in admin.transactions() if t["state"] == "ABORTED"]
        assert reasons == ["the writer failed: RuntimeError: the writer fails"], reasons


def test_readers_see_each_commit_whole(tmp_path) -> None:
    """Readers during commits: at every cut of the topic, each batch is there in full, in
    every partition, or not at all; and a tail consumer gets every row once."""
    batches, per_batch = 12, 300
    with running_log(tmp_path / "data", maxEntriesPerSegment="3") as log:
        with Admin(log.url) as admin:
            admin.create_topic(TOPIC, 3)
        consumer = Consumer(TOPIC, "audit", initial=Offset.earliest(), broker=log.url)
        stop = threading.Event()
        snapshots: list[Counter[str]] = []

        def snapshot_reader() -> None:
            with Admin(log.url) as admin:
                while not stop.is_set():
                    cut = admin.latest_cut(TOPIC)
                    values: list[str] = []
                    for p in cut.partitions:
                        for b in read(TOPIC, partition=p, broker=log.url,
                                      end=Offset.at_position(cut[p])):
                            values.extend(_values(pa.Table.from_batches([b])))
                    snapshots.append(Counter(v.split("-")[0] for v in values))

        thread = threading.Thread(target=snapshot_reader)
        thread.start()
        for b in range(batches):
            with Transaction(broker=log.url, sink="audit", batch=b) as txn:
                txn.write(TOPIC, _rows(f"b{b}", per_batch, keys=50))
            # once the commit returns, the whole batch is readable
            counts = Counter(v.split("-")[0] for v in _values(read_all(log.url, TOPIC)))
            assert counts == Counter({f"b{i}": per_batch for i in range(b + 1)})
        stop.set()
        thread.join(timeout=scaled(30))
        assert len(snapshots) > batches  # cuts were taken while commits were applied
        partial = [s for s in snapshots if any(n != per_batch for n in s.values())]
        assert not partial, f"a cut saw part of a commit: {partial[0]}"
        seen: list[str] = []
        while len(seen) < batches * per_batch:
            got = consumer.receive(timeout=scaled(30))
            assert got is not None, f"the consumer got {len(seen)} rows"
            seen.extend(_values(pa.Table.from_batches([got])))
        consumer.close()
        assert Counter(seen) == Counter(
            v for b in range(batches) for v in _values(_rows(f"b{b}", per_batch, keys=50)))


# -- crash points ---------------------------------------------------------------------------

CRASH_POINTS = ["txn.decided@1", "txn.partition-applied@1", "txn.partition-applied@2",
                "txn.applied@1"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_broker_killed_in_a_commit_ends_it_committed_never_half(
        start_broker, free_port, point) -> None:
    args = ("--max-entries-per-segment", "2")
    broker = start_broker(*args, port=free_port, env={ENV: point})
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 3)
        admin.create_topic(OTHER, 1)
    txn = Transaction(broker=broker.url, sink="crash", batch=7)
    txn.write(TOPIC, _rows("c", 3000, keys=30))
    txn.write(OTHER, _rows("o", 500))
    txn.prepare()
    with pytest.raises(Exception):  # noqa: B017 - the broker dies while answering
        txn.commit()
    _wait_killed(broker)
    restarted = start_broker(*args, port=free_port)
    # recovery applied the decided commit exactly once, in full
    assert Counter(_values(read_all(restarted.url, TOPIC))) == Counter(
        _values(_rows("c", 3000, keys=30)))
    assert Counter(_values(read_all(restarted.url, OTHER))) == Counter(
        _values(_rows("o", 500)))
    with Admin(restarted.url) as admin:
        # the driver retries its commit after the restart: a no-op
        assert admin.commit_transactions([txn.txn_id], sink="crash", batch=7)["status"] == \
            "already-committed"
        states = {t["txn_id"]: t["state"] for t in admin.transactions()}
        assert states[txn.txn_id] == "APPLIED"
        assert admin.action("stats")  # the broker serves
    assert read_all(restarted.url, TOPIC).num_rows == 3000


def test_a_broker_killed_before_the_decision_keeps_the_transaction_committable(
        start_broker, free_port) -> None:
    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    txn = Transaction(broker=broker.url, sink="pre", batch=0)
    txn.write(TOPIC, _rows("p", 100))
    txn.prepare()
    broker.kill()
    restarted = start_broker(port=free_port)
    assert read_all(restarted.url, TOPIC).num_rows == 0  # prepared is still invisible
    with Admin(restarted.url) as admin:
        assert admin.commit_transactions([txn.txn_id], sink="pre", batch=0)["messages"] == 100
    assert read_all(restarted.url, TOPIC).num_rows == 100


def _wait_killed(broker: BrokerProcess) -> None:
    assert broker.proc is not None
    wait_for(lambda: broker.proc is not None and broker.proc.poll() is not None, timeout=scaled(60),
             what="the broker to die at its crash point")
    assert broker.proc.returncode == -signal.SIGKILL, "".join(broker.stderr_tail)[-2000:]
