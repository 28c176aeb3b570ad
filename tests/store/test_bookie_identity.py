"""A network bookie knows who it is (its disk's cookie), which segments lack a copy is kept in
the metadata store, and an audit finds short copies (issue 47): real PostgreSQL, bookie and
broker processes on loopback."""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

import pytest

from tierstream.client import Admin
from tierstream.managed_ledger.bookies.remote import RemoteBookie

from ..network_store import BookieProcess
from ..ports import fixed_port
from ..postgres import PostgresServer
from ..timing import scaled
from .helpers import wait_for
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order

#: small segments: many of them, so every bookie holds copies of several closed ones
SMALL = ("--max-entries-per-segment", "10")


def _stats(url: str) -> dict[str, Any]:
    with Admin(url) as admin:
        return admin.stats()["replication"]  # type: ignore[no-any-return]


def _closed(url: str) -> list[Any]:
    with Admin(url) as admin:
        return [s for s in admin.list_segments(TOPIC) if s.state == "CLOSED"]


def _written_and_sealed(url: str, partitions: int, messages: int) -> int:
    """A topic of ``partitions`` written under load until ``messages`` more were
    acknowledged, then sealed: how many were acknowledged."""
    with Admin(url) as admin:
        admin.create_topic(TOPIC, partitions)
    writer = _Writer(url)
    try:
        writer.wait_for_more(messages)
        with Admin(url) as admin:
            admin.seal(TOPIC)
    finally:
        acked = writer.stop()
    return acked


def _listed(postgres: PostgresServer, url: str) -> int:
    import psycopg

    with psycopg.connect(url, connect_timeout=int(scaled(30))) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM under_replicated").fetchone()[0])


def _whole_everywhere(bookies: list[BookieProcess], url: str) -> None:
    """Every closed segment has a whole copy on each bookie of its ensemble."""
    clients = {f"bookie-{i}": RemoteBookie(f"bookie-{i}", str(b.url), host="-", epoch=0)
               for i, b in enumerate(bookies)}
    try:
        for seg in _closed(url):
            for b in seg.ensemble:
                assert len(clients[b].index(seg.segment_id)) >= seg.entries, (seg, b)
    finally:
        for c in clients.values():
            c.close()


def _refused(cmd: list[str]) -> str:
    """The one line a bookie that must not start prints (exit status 2, no traceback)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_bookie_whose_disk_was_lost_is_never_taken_for_itself_and_gets_its_copies_back(
        network_store, postgres) -> None:
    url, bookies, broker = network_store
    serving = broker("broker-a", *SMALL).start()
    acked = _written_and_sealed(serving.url, 2, 3_000)
    held = [s for s in _closed(serving.url) if "bookie-1" in s.ensemble]
    assert len(held) >= 4, held

    bookies[1].wipe()  # its disk is lost
    line = _refused(bookies[1].command())
    assert "bookie-1" in line and "--replace" in line and "lost" in line, line
    # another bookie's disk is not taken for this one's either
    other = BookieProcess(bookies[2].data_dir, url, host_label="x", bookie_id="bookie-1")
    line = _refused(other.command())
    assert "bookie-2" in line and "--bookie-id bookie-2" in line, line
    assert _stats(serving.url)["under_replicated"] == 0  # nothing judged while it is away

    bookies[1].start("--replace")
    # listed at once, in the metadata store, before the bookie took a write
    assert _listed(postgres, url) >= len(held)
    wait_for(lambda: _stats(serving.url)["under_replicated"] == 0 and
             _listed(postgres, url) == 0, timeout=scaled(120),
             what="every copy the lost disk held to be whole again")
    assert _stats(serving.url)["re_replicated"] >= len(held)
    _whole_everywhere(bookies, serving.url)
    check_exactly_once_in_order(_read(serving.url), acked)
    _no_appends_to_what_predates_the_disk(url, max(s.segment_id for s in _closed(serving.url)))
    # the replacement is the bookie now: restarted, it is itself without --replace
    bookies[1].restart()
    line = _refused(bookies[1].command("--replace"))
    assert "without --replace" in line, line


def _no_appends_to_what_predates_the_disk(url: str, newest: int) -> None:
    """The replacing disk takes no append for a ledger that predates it, not even its entry
    0 at any epoch (the lost disk's fence of it is gone). Writers of older epochs than the
    newest write new ledgers there: on a cluster they are live brokers. (Regression: an
    epoch floor at the newest epoch refused every other broker of a cluster, which then
    stopped as fenced.)"""
    from tierstream.errors import ConflictError
    from tierstream.metadata.bookie_registry import bookie_registration, network_bookies
    from tierstream.metadata.store import MetadataStore

    from .test_network_bookies import _payload

    metadata = MetadataStore(url, hold=False)
    try:
        (_, address, _, instance), = [b for b in network_bookies(metadata)
                                      if b[0] == "bookie-1"]
        for epoch, segment_id, refused in ((0, newest + 1000, False), (10**6, newest, True)):
            client = RemoteBookie("bookie-1", address, host="-", epoch=epoch,
                                  instance=instance, registration=lambda: bookie_registration(
                                      metadata, "bookie-1"))
            try:
                appended = client.append(segment_id, 0, {}, _payload(0), 1, 1, 1)
                if refused:
                    with pytest.raises(ConflictError, match="predates the disk"):
                        appended.result(timeout=scaled(30))
                else:
                    assert appended.result(timeout=scaled(30)).entry_id == 0
            finally:
                client.close()
    finally:
        metadata.close()


def test_which_segments_lack_a_copy_outlives_the_broker_that_learnt_it(network_store,
                                                                       postgres) -> None:
    """Regression: the list lived in the serving broker's memory; a broker that took over
    reported under_replicated 0 and repaired nothing of it."""
    url, bookies, broker = network_store
    # no periodic audit: what the second broker knows, it knows from the list
    first = broker("broker-a", *SMALL, "--bookie-audit-interval", "1h").start()
    with Admin(first.url) as admin:
        admin.create_topic(TOPIC, 2)
    writer = _Writer(first.url)
    try:
        writer.wait_for_more(1_000)
        bookies[1].kill()
        writer.wait_for_more(2_000)  # segments sealed without it, more placed on two
        with Admin(first.url) as admin:
            admin.seal(TOPIC)
    finally:
        acked = writer.stop()
    wait_for(lambda: _stats(first.url)["under_replicated"] > 0, timeout=scaled(30),
             what="segments listed as lacking a copy")
    before = _listed(postgres, url)
    first.kill()
    second = broker("broker-b", *SMALL, "--bookie-audit-interval", "1h").start()
    wait_for(lambda: _stats(second.url)["under_replicated"] >= before, timeout=scaled(30),
             what="the new broker to report what the old one listed")
    bookies[1].restart()
    wait_for(lambda: _stats(second.url)["under_replicated"] == 0, timeout=scaled(120),
             what="the new broker to repair what the old one listed")
    _whole_everywhere(bookies, second.url)
    check_exactly_once_in_order(_read(second.url), acked)


def test_an_audit_finds_a_copy_lost_behind_the_broker_s_back(network_store) -> None:
    _, bookies, broker = network_store
    serving = broker("broker-a", *SMALL, "--bookie-audit-interval", "1s").start()
    acked = _written_and_sealed(serving.url, 1, 1_000)
    victim = next(s for s in _closed(serving.url) if "bookie-2" in s.ensemble)
    repaired = _stats(serving.url)["re_replicated"]
    for path in (bookies[2].data_dir / "ledgers").rglob(f"{victim.segment_id}.*"):
        path.unlink()  # the bookie answers, but its copy is gone
    wait_for(lambda: _stats(serving.url)["re_replicated"] > repaired, timeout=scaled(60),
             what="the audit to find the lost copy and re-replicate it")
    wait_for(lambda: _stats(serving.url)["under_replicated"] == 0, timeout=scaled(60),
             what="nothing left to repair")
    assert _stats(serving.url)["last_audit"]["found"] >= 0
    _whole_everywhere(bookies, serving.url)
    check_exactly_once_in_order(_read(serving.url), acked)


def test_a_standby_rides_out_postgresql_restarts_and_then_takes_over(tmp_path) -> None:
    """Regression: a standby reused its start-up session after a PostgreSQL restart and died
    taking over (``unexpected OperationalError``), and exited on a short outage or restart
    that the serving broker waits out. Here PostgreSQL restarts twice (once while it is
    down for seconds) with a standby waiting; neither broker exits, the serving one keeps
    the store (a restart frees the lock: the standby leaves it to the live holder), and
    when the serving broker is SIGKILLed the standby takes over."""
    from ..postgres import started

    server = started()  # its own: this test stops it
    bookies: list[BookieProcess] = []
    brokers: list[Any] = []
    try:
        url = server.new_database()
        bookies += [BookieProcess(tmp_path / f"bookie-{i}", url,
                                  host_label=f"host-{i}").start() for i in range(3)]
        from tierstream.broker.process import BrokerProcess

        from ..network_store import broker_args

        def broker(name: str, *extra: str) -> BrokerProcess:
            proc = BrokerProcess(tmp_path / name, args=broker_args(url, *extra))
            brokers.append(proc)
            return proc

        serving = broker("broker-a").start()
        with Admin(serving.url) as admin:
            admin.create_topic(TOPIC, 2)
        standby = broker("broker-b", "--standby", "--takeover-after", f"{scaled(3):g}s")
        import threading

        start = threading.Thread(target=lambda: standby.start(timeout=scaled(240)))
        start.start()
        wait_for(lambda: "standing by" in "".join(standby.stderr_tail), timeout=scaled(60),
                 what="the standby to stand by")
        writer = _Writer(serving.url)
        try:
            writer.wait_for_more(500)
            for outage in (0.0, scaled(3)):
                server.halt()
                time.sleep(outage)  # a server away for a while, not only restarted
                server.resume()
                writer.wait_for_more(500)  # the serving broker goes on after it
            assert standby.url is None, "the standby took a live broker's store over"
            assert serving.proc is not None and serving.proc.poll() is None
            assert standby.proc is not None and standby.proc.poll() is None, \
                "".join(standby.stderr_tail)
        finally:
            acked = writer.stop()
        serving.kill()
        start.join(timeout=scaled(240))
        assert standby.url is not None, "".join(standby.stderr_tail)
        said = "".join(standby.stderr_tail)
        # the CLI's line for an error nobody foresaw (PostgreSQL's own "closed the
        # connection unexpectedly", in a warning about the outage, is not one)
        assert "Traceback" not in said and not re.search(r"unexpected \w+Error", said), said
        check_exactly_once_in_order(_read(standby.url), acked)
    finally:
        for proc in brokers:
            proc.kill()
        for bookie in bookies:
            bookie.kill()
        server.stop()


@pytest.mark.parametrize("open_segment", ["with entries", "empty"])
def test_two_bookies_down_are_told_once_not_at_every_retry(network_store, open_segment
                                                           ) -> None:
    """Regression: with two of three bookies down, a producer's every retry sealed the
    same segment again (a metadata write, and 'sealed without 2 of its bookies' ~140 times
    a second); now the partition waits for bookies without touching the sealed segment,
    each bookie's outage is one line, and its end one line with what it missed. And again
    when the open segment had no entry yet: closing it deleted its ledger on each bookie, a
    bookie that was down failed that, and the next retry closed it again (197 lines once)."""
    import threading

    from tierstream.client import Producer

    _, bookies, broker = network_store
    serving = broker("broker-a").start()
    with Admin(serving.url) as admin:
        admin.create_topic(TOPIC, 1)
    acked = [0]
    stop = threading.Event()

    def produce() -> None:
        with Producer(TOPIC, broker=serving.url, name="patient", batch_size=20,
                      send_timeout=scaled(120)) as producer:
            while not stop.is_set():
                producer.send_many({"key": "k0", "value": b"k0:0"} for _ in range(20))
                acked[0] += 20

    writer = threading.Thread(target=produce, daemon=True)
    writer.start()
    try:
        wait_for(lambda: acked[0] >= 200, what="acks")
        if open_segment == "empty":  # a new open segment, on all three bookies, then none
            with Admin(serving.url) as admin:
                admin.seal(TOPIC)
        bookies[1].kill()
        bookies[2].kill()
        with Admin(serving.url) as admin:
            wait_for(lambda: not any(admin.stats()["bookies"][f"bookie-{i}"]["available"]
                                     for i in (1, 2)), what="both bookies taken for gone")
        time.sleep(scaled(3))  # a window of retries to count lines in, not a wait on a state
        stalled = acked[0]
        bookies[1].restart()
        bookies[2].restart()
        wait_for(lambda: acked[0] >= stalled + 200, timeout=scaled(120),
                 what="acks after the bookies came back")
        with Admin(serving.url) as admin:
            wait_for(lambda: all(b["available"] for b in admin.stats()["bookies"].values()),
                     timeout=scaled(60), what="both bookies to answer again")
    finally:
        stop.set()
        writer.join(timeout=scaled(120))
    said = "".join(serving.stderr_tail)
    lines = said.splitlines()
    assert sum("sealed without" in line for line in lines) <= 2, said[-3000:]
    gone = [line for line in lines
            if "tierstream.managed_ledger.bookies.remote: bookie" in line
            and "is unavailable:" in line]
    assert len(gone) <= 2 and said.count("answers again") == 2, said[-3000:]
    # and nothing told at every pass of the repair or every retry of the producer, nor
    # Arrow's own lines for the broken streams ("status.cc:182: Close() failed: ...")
    assert len(lines) < 40 and "status.cc" not in said, said[-3000:]


def _bookie_1_killed_under_load(network_store: Any, partitions: int) -> tuple[Any, _Writer]:
    """(a broker of small segments, a writer at work on a topic of ``partitions``) once
    bookie-1 was SIGKILLed under that load and the broker took it for gone."""
    _, bookies, broker = network_store
    serving = broker("broker-a", *SMALL).start()
    with Admin(serving.url) as admin:
        admin.create_topic(TOPIC, partitions)
    writer = _Writer(serving.url)
    try:
        writer.wait_for_more(300)
        bookies[1].kill()
        with Admin(serving.url) as admin:
            wait_for(lambda: not admin.stats()["bookies"]["bookie-1"]["available"],
                     what="bookie-1 taken for gone")
    except BaseException:
        writer.stop()
        raise
    return serving, writer


def test_a_bookie_s_address_answered_by_another_endpoint_is_not_taken_for_it(
        network_store, tmp_path) -> None:
    """Regression (a suite run on CI): while bookie-1 was down, another test's broker took its
    port for a read-only endpoint of its own bookie-0. Its ping answered, so bookie-1 was
    taken for back; the next seal there failed 'bookie endpoint bookie-0 is read-only' and
    the producer got that error and died. An endpoint that takes writes, of another bookie
    (another store's), was worse: its copies counted towards the ack quorum. Now every call
    names the bookie it is for, and an endpoint that is another one is that bookie being
    unavailable."""
    from tierstream.bookie.server import BookieServer

    _, bookies, _ = network_store
    serving, writer = _bookie_1_killed_under_load(network_store, 2)
    try:
        impostors = [  # (bookie id, takes writes, what bookie-1's state then says)
            ("bookie-0", False, "is bookie bookie-0, not bookie-1"),
            ("bookie-1", False, "serves bookie bookie-1 read-only"),
            ("bookie-1", True, "another disk of bookie bookie-1")]
        for i, (other, writable, said) in enumerate(impostors):
            where = tmp_path / f"elsewhere-{i}" / other
            where.mkdir(parents=True)
            impostor = BookieServer(where, bookie_id=other, port=bookies[1].port,
                                    writable=writable, fsync=False)
            if impostor.writes is not None:  # a bookie of another store, its disk claimed
                impostor.writes.claimed("another-store-s-disk", 0)
            try:
                with Admin(serving.url) as admin:
                    def pinged(admin: Admin = admin, said: str = said) -> bool:
                        state = admin.stats()["bookies"]["bookie-1"]  # taken for it, or not
                        return bool(state["available"]) or \
                            said in state.get("unavailable_because", "")

                    wait_for(pinged, what="bookie-1's address pinged again")
                    writer.wait_for_more(1_000)  # new segments placed meanwhile
                    state = admin.stats()["bookies"]["bookie-1"]
                assert not state["available"], state
                assert said in state["unavailable_because"], state
            finally:
                impostor.shutdown()
            assert not list(where.rglob("*.log")), "a copy written to another bookie"
        bookies[1].restart()
        writer.wait_for_more(500)
    finally:
        acked = writer.stop()
    check_exactly_once_in_order(_read(serving.url), acked)
    # and segments placed on two bookies while bookie-1 was away are said once, not one
    # line per segment (20 a second here, with segments of 10 entries)
    said = "".join(serving.stderr_tail)
    assert 1 <= said.count("below the write quorum") <= 2, said[-3000:]


def test_a_bookie_restarted_at_another_address_is_found_there(network_store) -> None:
    """Regression: the broker wrote to the address each bookie had when the broker started.
    A bookie restarted on another port (or its host with another address) registered the
    new one, but the broker kept pinging the old one: the bookie stayed unavailable and every
    new segment had two copies until the broker restarted. A ping that finds nobody now asks
    the registration."""
    _, bookies, _ = network_store
    serving, writer = _bookie_1_killed_under_load(network_store, 1)
    try:
        with Admin(serving.url) as admin:
            old = bookies[1].url
            bookies[1].port = fixed_port()
            bookies[1].start()
            assert bookies[1].url != old
            wait_for(lambda: admin.stats()["bookies"]["bookie-1"] == {
                **admin.stats()["bookies"]["bookie-1"], "available": True,
                "where": bookies[1].url}, timeout=scaled(60),
                what="bookie-1 found at its new address")
        writer.wait_for_more(300)
        with Admin(serving.url) as admin:
            admin.seal(TOPIC)
    finally:
        acked = writer.stop()
    newest = _closed(serving.url)[-1]  # placed after the move: on all three again
    assert sorted(newest.ensemble) == ["bookie-0", "bookie-1", "bookie-2"], newest
    check_exactly_once_in_order(_read(serving.url), acked)
    assert "bookie-1 registered a new address" in "".join(serving.stderr_tail)


def test_a_disk_replaced_behind_an_idle_client_is_adopted_at_its_next_call(
        network_store) -> None:
    """Regression (a 100-fault network chaos run: 162 segments stayed under-replicated): a
    bookie whose disk was replaced (``--replace``) while the broker's client of it had no
    append stream open stayed 'available' with the old disk's instance, so every call of
    the repairer was refused as another disk, and tried again for good. A call that finds
    the bookie unavailable now takes it for down, and the next ``is_available()`` pings it
    and adopts the disk its registration names."""
    from tierstream.errors import UnavailableError
    from tierstream.metadata.bookie_registry import bookie_registration, network_bookies
    from tierstream.metadata.store import MetadataStore

    url, bookies, _ = network_store
    metadata = MetadataStore(url, hold=False)
    try:
        (_, address, _, instance), = [b for b in network_bookies(metadata)
                                      if b[0] == "bookie-1"]
        client = RemoteBookie("bookie-1", address, host="-", epoch=1, instance=instance,
                              registration=lambda: bookie_registration(metadata, "bookie-1"))
        try:
            assert client.ledger_entries() == {}  # a control call: no stream is opened
            bookies[1].wipe()
            bookies[1].start("--replace")
            with pytest.raises(UnavailableError, match="another disk of bookie bookie-1"):
                client.ledger_entries()
            assert client.is_available()  # pinged: the registration names the new disk
            assert client.ledger_entries() == {} and client.instance != instance
        finally:
            client.close()
    finally:
        metadata.close()
