"""PostgreSQL that vanishes without a word for a broker whose host is cut off (a network
namespace's link down: every packet dropped, no reset, no FIN). Collected by
``test_network_namespaces.py``, with the other tests that stand in for hosts.

Regression: a metadata statement sent into the silence waited for the kernel's
retransmissions (about 15 minutes) with the broker's lock held; the outage limit was never
applied and the broker neither went on nor stopped. Now every session takes its server for
gone after ``DEAD_PEER_S`` of silence (``metadata/postgres.py``), the broker takes its lock
back when the server answers again, and gives the database up at the outage limit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.metadata.postgres import DEAD_PEER_S

from ..network_store import Hosts, hosts_or_fail
from ..postgres import started_on
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/pg/silence"
TOKEN = "metadata-silence-test-token"
PORT = 6651


@pytest.fixture
def broker_a_host() -> Any:
    with hosts_or_fail(["broker-a"]) as h:
        yield h


def _said(broker: BrokerProcess, text: str) -> bool:
    return text in "".join(broker.stderr_tail)


@pytest.mark.slow
def test_a_broker_cut_off_from_postgresql_goes_on_after_a_short_cut_and_stops_at_the_limit(
        tmp_path: Path, broker_a_host: Hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTREAM_AUTH_TOKEN", TOKEN)  # off loopback, every call needs one
    server = started_on(broker_a_host.gateway)
    limit = scaled(3 * DEAD_PEER_S)
    broker = BrokerProcess(tmp_path / "broker", host=broker_a_host.address("broker-a"), port=PORT,
                           args=["--metadata", server.new_database().replace(
                               "127.0.0.1", broker_a_host.gateway), "--no-fsync"],
                           env={"TIERSTREAM_METADATA_OUTAGE_S": f"{limit:g}"},
                           prefix=["ip", "netns", "exec", broker_a_host.ns("broker-a")])
    try:
        broker.start(timeout=scaled(120))
        assert broker.url is not None and broker.proc is not None
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(TOPIC, broker=broker.url) as producer:
            producer.send_many({"value": f"a{i}"} for i in range(100))

        # a cut shorter than the limit: the heartbeat's statement goes into the silence, the
        # session is taken for dead, and when the host is back the broker holds its lock again
        broker_a_host.cut("broker-a")
        wait_for(lambda: _said(broker, "is unreachable"), timeout=scaled(6 * DEAD_PEER_S),
                 what="the broker to take its server for gone")
        broker_a_host.mend("broker-a")
        wait_for(lambda: _said(broker, "this broker holds its lock"),
                 timeout=scaled(6 * DEAD_PEER_S), what="the broker to take its lock back")
        assert broker.proc.poll() is None
        with Producer(TOPIC, broker=broker.url) as producer:  # it serves, metadata included
            producer.send_many({"value": f"b{i}"} for i in range(100))
        with Admin(broker.url) as admin:
            admin.create_topic("acme/pg/after", 1)

        # a cut past the limit: one line and a clean stop, at the limit plus the time it
        # takes to see the server gone, not after the kernel's retransmissions
        broker_a_host.cut("broker-a")
        cut_at = time.monotonic()
        code = broker.proc.wait(timeout=limit + scaled(6 * DEAD_PEER_S))
        took = time.monotonic() - cut_at
        assert code == 1, "".join(broker.stderr_tail)[-3000:]
        last = [line for line in broker.stderr_tail if line.strip()][-1]
        assert last.startswith("error: the metadata store") and "unreachable" in last, last
        assert "the broker stopped" in last and not broker.tracebacks, last
        assert took >= limit - scaled(2), took
        broker_a_host.mend("broker-a")

        # nothing acknowledged was lost: a restart serves all of it
        again = BrokerProcess(broker.data_dir, host=broker_a_host.address("broker-a"), port=PORT,
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
