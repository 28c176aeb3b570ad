"""PostgreSQL that vanishes without a word: the broker's host cut off (a network namespace's
link down: every packet dropped, no reset, no FIN), and a lock session the server keeps after
the broker gave it up.

Regression: a metadata statement sent into the silence waited for the kernel's
retransmissions (about 15 minutes) with the broker's lock held; the outage limit was never
applied and the broker neither went on nor stopped. Now every session takes its server for
gone after ``DEAD_PEER_S`` of silence (``metadata/postgres.py``), the broker takes its lock
back when the server answers again, and gives the database up at the outage limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.metadata.postgres import DEAD_PEER_S, PostgresBackend

from ..network_store import Hosts, hosts_or_fail
from ..postgres import started_on
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/pg/silence"
TOKEN = "metadata-silence-test-token"
PORT = 6651


@pytest.fixture
def hosts() -> Any:
    with hosts_or_fail(["broker-a"]) as h:
        yield h


def _said(broker: BrokerProcess, text: str) -> bool:
    return text in "".join(broker.stderr_tail)


@pytest.mark.slow
def test_a_broker_cut_off_from_postgresql_goes_on_after_a_short_cut_and_stops_at_the_limit(
        tmp_path: Path, hosts: Hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTREAM_AUTH_TOKEN", TOKEN)  # off loopback, every call needs one
    server = started_on(hosts.gateway)
    limit = scaled(3 * DEAD_PEER_S)
    broker = BrokerProcess(tmp_path / "broker", host=hosts.address("broker-a"), port=PORT,
                           args=["--metadata", server.new_database().replace(
                               "127.0.0.1", hosts.gateway), "--no-fsync"],
                           env={"TIERSTREAM_METADATA_OUTAGE_S": f"{limit:g}"},
                           prefix=["ip", "netns", "exec", hosts.ns("broker-a")])
    try:
        broker.start(timeout=scaled(120))
        assert broker.url is not None and broker.proc is not None
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=broker.url) as producer:
            producer.send_many({"value": f"a{i}"} for i in range(100))

        # a cut shorter than the limit: the heartbeat's statement goes into the silence, the
        # session is taken for dead, and when the host is back the broker holds its lock again
        hosts.cut("broker-a")
        wait_for(lambda: _said(broker, "is unreachable"), timeout=scaled(6 * DEAD_PEER_S),
                 what="the broker to take its server for gone")
        hosts.mend("broker-a")
        wait_for(lambda: _said(broker, "this broker holds its lock"),
                 timeout=scaled(6 * DEAD_PEER_S), what="the broker to take its lock back")
        assert broker.proc.poll() is None
        with Producer(TOPIC, broker=broker.url) as producer:  # it serves, metadata included
            producer.send_many({"value": f"b{i}"} for i in range(100))
        with Admin(broker.url) as admin:
            admin.create_topic("acme/pg/after", 1)

        # a cut past the limit: one line and a clean stop, at the limit plus the time it
        # takes to see the server gone, not after the kernel's retransmissions
        hosts.cut("broker-a")
        cut_at = time.monotonic()
        code = broker.proc.wait(timeout=limit + scaled(6 * DEAD_PEER_S))
        took = time.monotonic() - cut_at
        assert code == 1, "".join(broker.stderr_tail)[-3000:]
        last = [line for line in broker.stderr_tail if line.strip()][-1]
        assert last.startswith("error: the metadata store") and "unreachable" in last, last
        assert "the broker stopped" in last and not broker.tracebacks, last
        assert took >= limit - scaled(2), took
        hosts.mend("broker-a")

        # nothing acknowledged was lost: a restart serves all of it
        again = BrokerProcess(broker.data_dir, host=hosts.address("broker-a"), port=PORT,
                              args=broker.args, prefix=broker.prefix).start(timeout=scaled(120))
        try:
            assert again.url is not None
            values = sorted(bytes(v).decode() for v in
                            read_all(again.url, TOPIC).column("value").to_pylist())
            assert values == sorted([f"a{i}" for i in range(100)] + [f"b{i}" for i in range(100)])
        finally:
            again.kill()
    finally:
        broker.kill()
        server.stop()


def test_a_lock_session_the_server_still_keeps_is_ended_and_the_lock_taken_back(
        postgres: Any) -> None:
    """The lock's session lost on this side while the server keeps it (it has not seen it
    end: a server without the dead-peer settings, a pooler in between): the broker ends its
    own former session and holds the lock again, instead of taking it for another broker's
    and giving the database up."""
    url = postgres.new_database()
    backend = PostgresBackend(url, takeover_after_s=None)
    try:
        lease = backend.lease
        assert lease is not None
        session = lease._holder
        former = session.info.backend_pid
        # this side loses the session without a word to the server: libpq's socket now
        # leads to /dev/null, the real one is kept open (no FIN, no terminate message)
        kept = os.dup(session.fileno())
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, session.fileno())
        os.close(null)
        try:
            wait_for(lambda: backend.lost.is_set() or (lease._holder is not None
                                                        and lease._holder is not session),
                     timeout=scaled(6 * DEAD_PEER_S), what="the heartbeat to take the lock back")
            assert not backend.lost.is_set(), backend.lost_reason
            pids = [r[0] for r in backend.read(
                "SELECT pid FROM pg_stat_activity WHERE pid = ?", (former,))]
            assert pids == []  # the former session was ended by the broker
            assert lease._holder.info.backend_pid != former
        finally:
            os.close(kept)
    finally:
        backend.close()
