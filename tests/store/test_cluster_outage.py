"""Several brokers (``--cluster``) and their metadata store: PostgreSQL down for longer than
the lease, for every broker at once (none can take a partition over without it, so none
stops; when it is back, no partition moves), and a broker paused inside a transaction (its
row locks end with its session, which the taker ends)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..network_store import BookieProcess, broker_args
from ..postgres import started
from ..timing import scaled
from .helpers import stop_process, wait_for
from .test_cluster import _Received, _spread
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order

LEASE_S = scaled(3)


def _owners(url: str) -> dict[int, tuple[str, int]]:
    """Each partition's owner and the epoch of its claim."""
    with Admin(url) as admin:
        stats = admin.topic_stats(TOPIC, per_partition=True)
    return {p["partition"]: (p["owner"]["broker"], p["owner"]["epoch"])
            for p in stats["partitions"]}


def test_postgres_down_past_the_lease_for_every_broker_stops_none_and_moves_nothing(
        tmp_path: Path) -> None:
    """Two cluster brokers under a producer and a key_shared consumer; PostgreSQL is halted
    until both have gone more than two leases without renewing. Each serves on (every other
    broker answers that it cannot reach the metadata store either), and once PostgreSQL is
    back every partition is owned where it was, at the same epoch; every acknowledged
    message is read once in key order, and received. (Before, each broker stopped once its
    lease was unrenewed for a lease timeout: an ordinary database restart stopped the
    whole cluster.)"""
    server = started()  # a server of its own: it is halted
    procs: list[BookieProcess | BrokerProcess] = []
    try:
        url = server.new_database()
        for i in range(3):
            procs.append(BookieProcess(tmp_path / f"bookie-{i}", url,
                                       host_label=f"host-{i}").start())
        brokers = [BrokerProcess(tmp_path / name, args=broker_args(
            url, "--cluster", "--lease-timeout", f"{LEASE_S:g}s")) for name in ("a", "b")]
        procs += brokers
        for b in brokers:
            b.start(timeout=scaled(120))
        _spread(brokers, 4)
        both = ",".join(b.url for b in brokers)
        writer = _Writer(both, send_timeout=scaled(60))
        received = _Received(both)
        try:
            writer.wait_for_more(500)
            wait_for(lambda: all("sees 1 other live broker" in "".join(b.stderr_tail)
                                 for b in brokers), timeout=scaled(30),
                     what="each broker to know the other")
            before = _owners(brokers[0].url)
            server.halt()
            halted = time.monotonic()
            # the outage is the fault: it lasts (any broker that stops ends the wait)
            wait_for(lambda: time.monotonic() - halted > 2 * LEASE_S or any(
                b.proc is None or b.proc.poll() is not None for b in brokers),
                timeout=scaled(60), what="two leases of the metadata store away")
            for b in brokers:
                assert b.proc is not None and b.proc.poll() is None, \
                    "".join(list(b.stderr_tail)[-20:])
            server.resume()
            writer.wait_for_more(500)

            def renewed(b: BrokerProcess) -> bool:
                with Admin(b.url) as admin:
                    return float(admin.stats()["broker"]["lease_renewed_s_ago"]) < LEASE_S

            wait_for(lambda: all(renewed(b) for b in brokers), timeout=scaled(60),
                     what="both brokers to renew their lease again")
            writer.wait_for_more(500)
            assert _owners(brokers[1].url) == before, "".join(
                line for b in brokers for line in list(b.stderr_tail)[-25:])
        finally:
            acked = writer.stop()
        received.check(acked)
        check_exactly_once_in_order(_read(brokers[0].url), acked)
        for b in brokers:
            assert b.proc is not None and b.proc.poll() is None, \
                "".join(list(b.stderr_tail)[-20:])
            assert b.tracebacks == [], b.tracebacks
            assert "serves on" in "".join(b.stderr_tail), b.data_dir.name  # and said why
    finally:
        for proc in procs:
            proc.kill()
        server.stop()


def test_a_broker_paused_inside_a_metadata_transaction_holds_up_no_takeover(
        network_store) -> None:
    """B is SIGSTOPped while a session of its own holds the row of its open segment locked
    (as a broker paused mid-transaction does: the server keeps its locks while its session
    lives). A takes B's partition over once B's lease expired, and ends B's sessions first,
    so its recovery seals that segment and serves on. (Before, the seal waited for the lock
    for as long as B stayed paused: the partition was owned, and served by nobody.)"""
    import psycopg

    url, _, broker = network_store
    a, b = (broker(f"broker-{n}", "--cluster", "--lease-timeout", f"{LEASE_S:g}s").start()
            for n in "ab")
    _spread((a, b), 2)
    writer = _Writer(f"{a.url},{b.url}", send_timeout=scaled(5))  # B is left after it
    try:
        writer.wait_for_more(300)
        with Admin(b.url) as admin:
            b_id = admin.stats()["broker"]["id"]
            (held,) = [s for s in admin.list_segments(TOPIC) if s.state == "OPEN"]
        zombie = psycopg.connect(url, application_name=f"tierstream-broker/{b_id}")
        zombie.execute("SELECT segment_id FROM segments WHERE segment_id = %s FOR UPDATE",
                       (held.segment_id,))  # in a transaction, left open
        assert b.proc is not None
        stop_process(b.proc.pid)
        try:
            def sealed() -> bool:
                with Admin(a.url) as admin:
                    return any(s.segment_id == held.segment_id and s.state == "CLOSED"
                               for s in admin.list_segments(TOPIC))

            wait_for(sealed, timeout=scaled(60), what=f"A to take B's partition over and "
                     f"seal its segment {held.segment_id}, locked by B's session")
            writer.wait_for_more(300)  # both partitions at A
            try:
                zombie.execute("SELECT 1")
                raise AssertionError("B's locking session was not ended")
            except psycopg.OperationalError:
                pass  # ended by A
        finally:
            b.proc.send_signal(signal.SIGCONT)
            zombie.close()
    finally:
        acked = writer.stop()
    check_exactly_once_in_order(_read(a.url), acked)
