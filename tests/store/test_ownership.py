"""Which broker owns each partition (``metadata/ownership.py``): claims by epoch, and every new
segment and seal checked against the owner in its own transaction — on both metadata backends,
in a broker's store, and in the stats of a broker process."""

from __future__ import annotations

import re
import threading

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tierstream.client import Admin, Consumer, Producer, read
from tierstream.client.connection import BrokerClient
from tierstream.errors import FencedError, NotOwnerError
from tierstream.metadata.ownership import PartitionOwners
from tierstream.metadata.records import SegmentState
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.model.positions import Offset
from tierstream.wire.flight import encode, translate_errors

from ..cli.test_cli import run
from ..logs import append, running_log
from ..timing import scaled
from .helpers import wait_for
from .test_tier import TOPIC as TIER_TOPIC
from .test_tier import fill, make_store

TOPIC = "acme/owners/clicks"
ENSEMBLE = ("bookie-0",)


def test_a_partition_taken_over_refuses_its_former_owner_which_is_told_the_new_one(
        metadata_store: MetadataStore) -> None:
    store = metadata_store
    _, (first, _) = store.create_topic(TopicName.parse(TOPIC), 2, created_at=1,
                                       ensembles=[ENSEMBLE] * 2)
    old = PartitionOwners(store, "broker-1", 1)
    assert old.claim([(TOPIC, 0), (TOPIC, 1)]) == {}
    old.advertise("grpc://10.0.0.1:6651")
    store.owner = old
    opened = store.new_segment(TOPIC, 1, ensemble=ENSEMBLE, created_at=2)

    new = PartitionOwners(store, "broker-2", 2)
    new.advertise("grpc://10.0.0.2:6651", "pulsar://10.0.0.2:6650")
    assert new.claim([(TOPIC, 0)]) == {"broker-1": 1}
    new.renew()  # its lease, by the server's clock (advertising renewed it too)
    heard = [o.heard_ms_ago for o in new.of_topic(TOPIC).values()]
    assert all(h is not None and -1000 < h < 60_000 for h in heard), heard
    with pytest.raises(NotOwnerError, match="served by broker-2") as moved:
        old.renew()
        old.serving(TOPIC, 0)
    assert moved.value.owner_url == "grpc://10.0.0.2:6651"
    old.serving(TOPIC, 1)  # still its own

    # the former owner can neither add to partition 0 nor seal in it, and is told who owns it
    before = store.segments(TOPIC, 0)
    owner = r"broker-2 at grpc://10\.0\.0\.2:6651 \(epoch 2\)"
    with pytest.raises(NotOwnerError, match=f"{TOPIC} partition 0: it is owned by {owner}"):
        store.new_segment(TOPIC, 0, ensemble=ENSEMBLE, created_at=3)
    sealed = first.with_stats(state=SegmentState.CLOSED, entries=1, messages=1, bytes=10,
                              min_publish_time=1, max_publish_time=1, sealed_at=4)
    with pytest.raises(NotOwnerError, match=owner) as refused:
        store.seal_segment(sealed, {"writer": (1, {"at": 0})})
    assert isinstance(refused.value, FencedError)  # clients go to another broker
    assert store.segments(TOPIC, 0) == before  # nothing of either was written
    # nor can it delete in partition 0 or move its segments to the tier
    sid = first.segment_id
    for change in (lambda: store.delete_segment(sid),
                   lambda: store.set_offload_pending(sid, "file:///t/x.parquet"),
                   lambda: store.flip_to_tier(sid, "file:///t/x.parquet", offloaded_at=5),
                   lambda: store.mark_bookie_deleted(sid, deleted_at=5),
                   lambda: store.record_deletion(first, deleted_at=5, reason="retention")):
        with pytest.raises(NotOwnerError, match=owner):
            change()
    assert store.segments(TOPIC, 0) == before and store.deleted_segments(TOPIC) == []
    # its last cursor writes are stored for the partition it still owns only: the new
    # owner's cursor of partition 0 is not written over (its messages come again)
    store.owner = new  # the new owner writes its cursor of partition 0
    store.save_cursors([(TOPIC, "audit", 0, {"new": 2})], now=6)
    store.owner = old
    store.save_cursors([(TOPIC, "audit", 0, {"old": 1}), (TOPIC, "audit", 1, {"old": 1})],
                       now=7)
    assert [(r["partition"], r["state"]) for r in store.cursors(TOPIC)] == \
        [(0, {"new": 2}), (1, {"old": 1})]
    assert store.load_dedup(TOPIC, 0) == {}
    # partition 1 is still its own
    store.seal_segment(opened.with_stats(state=SegmentState.CLOSED, sealed_at=5), {})
    # claims only go up: the former owner cannot take the partition back
    with pytest.raises(NotOwnerError, match=owner):
        old.claim([(TOPIC, 0), (TOPIC, 1)])
    assert old.of_topic(TOPIC)[1].broker_id == "broker-1"  # the refused claim took nothing

    store.owner = new
    store.seal_segment(sealed, {})
    assert store.get_segment(first.segment_id).state == SegmentState.CLOSED
    # a new partition belongs to the broker that opens its first segment
    store.new_segment(TOPIC, 2, ensemble=ENSEMBLE, created_at=6)
    owners = new.of_topic(TOPIC)
    assert {p: o.broker_id for p, o in owners.items()} == \
        {0: "broker-2", 1: "broker-1", 2: "broker-2"}
    assert (owners[0].url, owners[0].pulsar_url, owners[1].pulsar_url) == \
        ("grpc://10.0.0.2:6651", "pulsar://10.0.0.2:6650", None)
    assert (new.owned(), old.owned()) == (2, 1)

    # a deleted topic's partitions are nobody's; a broker owning nothing is forgotten
    store.purge_topic(TOPIC)
    assert new.of_topic(TOPIC) == {}
    PartitionOwners(store, "broker-3", 3).claim([])
    assert store.query("SELECT broker_id FROM brokers ORDER BY broker_id") == []


def _url_of(owners: PartitionOwners, partition: int) -> str | None:
    owner = owners.elsewhere(TOPIC, partition)
    return None if owner is None else owner.url


def test_a_renewal_reads_the_owners_again_only_when_a_claim_or_an_address_changed_them(
        metadata_store: MetadataStore) -> None:
    """Every claim, new partition, address and deleted topic bumps ``meta.owners_version``;
    a renewal that finds the version it read last keeps its view without reading the owners
    (the cost of a renewal no longer grows with the partitions other brokers own)."""
    store = metadata_store
    store.create_topic(TopicName.parse(TOPIC), 2, created_at=1, ensembles=[ENSEMBLE] * 2)
    here = PartitionOwners(store, "broker-1", 1)
    here.claim([(TOPIC, 0), (TOPIC, 1)])
    there = PartitionOwners(store, "broker-2", 2)
    there.advertise("grpc://10.0.0.2:6651")
    there.claim([(TOPIC, 1)])
    here.renew()
    assert here.elsewhere(TOPIC, 1) is not None
    version = store.query("SELECT value FROM meta WHERE key='owners_version'")
    here.renew()  # nothing changed: the view stays
    assert store.query("SELECT value FROM meta WHERE key='owners_version'") == version
    assert _url_of(here, 1) == "grpc://10.0.0.2:6651"
    there.advertise("grpc://10.0.0.3:6651")  # the owner moved: its address is read again
    here.renew()
    assert _url_of(here, 1) == "grpc://10.0.0.3:6651"
    store.purge_topic(TOPIC)  # a deleted topic's owners are gone from the view
    here.renew()
    assert here.elsewhere(TOPIC, 1) is None


def test_a_broker_whose_partitions_were_taken_over_lets_them_go_and_serves_the_others(
        tmp_path) -> None:
    """Partitions claimed by a newer broker: a seal of one is refused by the metadata, and an
    append to another whose open ledger the new owner fenced is refused by the bookie.
    Regression: either stopped the whole broker ('no longer serves the store', every
    partition refused). It is those partitions alone that moved: each is let go, its
    clients are told the owner, and the other partitions go on."""
    with running_log(tmp_path / "data") as log:
        log.store.create_topic(TOPIC, 3)
        with Producer(TOPIC, broker=log.url) as producer:
            producer.send_many({"key": f"k{i}", "value": b"v"} for i in range(30))
        assert log.store.owners.owned() == 3
        newer = PartitionOwners(log.store.metadata, "broker-99", log.store.epoch + 1)
        newer.advertise("grpc://10.0.0.9:6651")
        newer.claim([(TOPIC, 1), (TOPIC, 2)])  # as a newer broker taking them over would
        owner = re.escape("broker-99 at grpc://10.0.0.9:6651")
        with pytest.raises(NotOwnerError, match=owner):
            log.store.seal(TOPIC, 1)
        # the new owner fences partition 2's open ledger (BookKeeper's recovery)
        (open_2,) = [s for s in log.store.metadata.segments(TOPIC, 2)
                     if s.state == SegmentState.OPEN]
        for b in open_2.ensemble:
            log.store.bookies[b].storage.fence(open_2.segment_id, log.store.epoch + 1)
        with pytest.raises(NotOwnerError, match=owner):
            append(log.store, 2, ["late"], keys=["k"], times=[None], topic=TOPIC)
        assert not log.store.fenced.is_set()
        log.store.check_serving()  # the broker goes on, with partition 0
        append(log.store, 0, ["after"], keys=["k"], times=[None], topic=TOPIC)
        assert log.store.seal(TOPIC, 0)
        assert [p.partition for p in log.store.partitions(TOPIC) if p.lost] == [1, 2]
        # the partitions' open segments are left to their owner to fence and seal
        for p in (1, 2):
            assert log.store.metadata.segments(TOPIC, p)[-1].state == SegmentState.OPEN


def test_stats_say_which_broker_owns_each_partition_and_a_restart_claims_them_all(
        start_broker) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
        first = admin.topic_stats(TOPIC, per_partition=True)
        me, brokers = admin.stats()["broker"], admin.stats()["brokers"]
    assert me["partitions_owned"] == 2 and me["id"] == f"broker-{me['epoch']}"
    owners = [p["owner"] for p in first["partitions"]]
    assert [(o["broker"], o["url"]) for o in owners] == [(me["id"], broker.url)] * 2
    heard = first["owners"][0].pop("heard_ms_ago")  # its lease, by the metadata's clock
    assert first["owners"] == [{"broker": me["id"], "epoch": me["epoch"], "url": broker.url,
                                "pulsar_url": None, "admin_url": None, "partitions": 2}]
    assert 0 <= heard <= scaled(5) * 1000 and me["lease_renewed_s_ago"] <= scaled(5)
    assert [(b["broker"], b["url"], b["partitions"], b["this"]) for b in brokers] == \
        [(me["id"], broker.url, 2, True)]
    env = {"TIERSTREAM_BROKER": broker.url or ""}
    table = run("topic", "stats", TOPIC, "--per-partition", env=env)
    assert table.returncode == 0, table.stderr
    owned = f"owned by {me['id']} at {broker.url} (epoch {me['epoch']}, lease renewed "
    assert "partition 1: in" in table.stdout and owned in table.stdout.replace("\n", " ")
    brk = run("broker", "stats", env=env)
    assert f"{me['id']} (epoch {me['epoch']}), owns 2 partition(s), lease renewed " \
        in brk.stdout
    assert re.search(rf"brokers +{me['id']} at {re.escape(broker.url or '')} \(epoch "
                     rf"{me['epoch']}, lease renewed [0-9.]+ s ago\): 2 partition\(s\) "
                     r"\(this one\)", brk.stdout), brk.stdout

    broker.stop()
    again = broker.start()
    with Admin(again.url) as admin:
        now, brokers = admin.stats()["broker"], admin.stats()["brokers"]
        owners = [p["owner"] for p in admin.topic_stats(TOPIC, per_partition=True)["partitions"]]
    assert now["epoch"] > me["epoch"] and now["partitions_owned"] == 2
    assert {o["broker"] for o in owners} == {now["id"]}
    assert [b["broker"] for b in brokers] == [now["id"]]  # the former one owns nothing
    said = f"owns the store's 2 partitions, taken over from {me['id']} (2)"
    wait_for(lambda: said in "".join(again.stderr_tail), scaled(10), what=said)


def test_a_broker_refuses_streams_of_a_partition_owned_elsewhere_and_producers_follow(
        tmp_path) -> None:
    """Two brokers on stores of their own; in the metadata of ``here``, partition 1 is owned
    by ``owner`` (as a broker that took it over would have claimed it). Once ``here`` renews
    its lease, its Flight streams of partition 1 are refused with the owner's address as
    data, nothing is stored there, and a Producer given only ``here`` writes partition 1 to
    ``owner``."""
    with running_log(tmp_path / "owner") as owner, running_log(tmp_path / "here") as here:
        for log in (owner, here):
            log.store.create_topic(TOPIC, 2)
        newer = PartitionOwners(here.store.metadata, "broker-99", here.store.epoch + 1)
        newer.advertise(owner.url)
        newer.claim([(TOPIC, 1)])
        here.store.owners.renew()  # what its lease thread does every second
        assert here.store.owners.of_topic(TOPIC)[1].heard_ms_ago is not None

        ticket = {"op": "consume", "topic": TOPIC, "partition": 1, "end": {"kind": "latest"}}
        raw = flight.connect(here.url)  # what any Flight client gets
        with pytest.raises(NotOwnerError) as refused, translate_errors(here.url):
            raw.do_get(flight.Ticket(encode(ticket))).read_all()
        raw.close()
        assert refused.value.owner_url == owner.url
        assert f"served by broker-99 at {owner.url}" in str(refused.value)
        with BrokerClient(here.url) as client:  # tierstream's client follows it
            assert client.consume(ticket).read_all().num_rows == 0
            assert client.url_for(ticket) == owner.url

        with Producer(TOPIC, broker=here.url) as producer:
            acks = producer.send_many({"key": f"k{i}", "value": f"v{i}".encode()}
                                      for i in range(40))
        assert {a["partition"] for a in acks} == {0, 1}
        stored = {name: [(p.partition, r["value"]) for p in log.store.partitions(TOPIC)
                         for b in p.read(p.earliest(), end=p.last_confirmed()[1])
                         for r in b.to_pylist()]
                  for name, log in (("here", here), ("owner", owner))}
        # each partition's end, as the Spark source and following reads pin them: partition
        # 1's from its owner (the end ``here`` still has of it is where it lost it)
        with Admin(here.url) as admin:
            assert admin.ends(TOPIC) == {0: here.store.ends(TOPIC)[0],
                                         1: owner.store.ends(TOPIC)[1]}
        assert here.store.ends(TOPIC)[1] != owner.store.ends(TOPIC)[1]
        assert {p for p, _ in stored["here"]} == {0}
        assert {p for p, _ in stored["owner"]} == {1}
        assert sorted(v for rows in stored.values() for _, v in rows) == \
            sorted(f"v{i}".encode() for i in range(40))
        read_back = [v for b in read(TOPIC, broker=here.url, end=Offset.latest())
                     for v in b.column("value").to_pylist()]  # each partition at its owner
        assert sorted(read_back) == sorted(f"v{i}".encode() for i in range(40))
        # a Consumer given only ``here`` reads and acknowledges partition 1 at its owner
        got: list[bytes] = []
        with Consumer(TOPIC, "audit", initial=Offset.earliest(), broker=here.url) as consumer:
            while len(got) < 40:
                batch = consumer.receive(timeout=scaled(30))
                assert batch is not None, f"{len(got)} of 40 received"
                got += batch.column("value").to_pylist()
                consumer.ack(batch)
        assert sorted(got) == sorted(f"v{i}".encode() for i in range(40))
        for log, partition in ((here, 0), (owner, 1)):
            with Admin(log.url) as admin:
                rows = {r["partition"]: r for r in admin.subscriptions(TOPIC)}
            assert rows[partition]["backlog"] == 0, (partition, rows)
        assert not here.store.fenced.is_set()  # it refused; it did not stop


def test_two_brokers_opening_one_new_partition_at_once_leave_one_owner_and_refuse_the_other(
        postgres) -> None:
    """PostgreSQL: broker B's claim of a new partition is inserted but not committed when
    broker A's transaction finds the partition unowned and inserts too. A waits for B; once
    B commits, A is refused naming B — it was a unique-key violation, an error nobody
    foresaw, before."""
    url = postgres.new_database()
    first, second = MetadataStore(url), MetadataStore(url, hold=False)
    try:
        a, b = PartitionOwners(first, "broker-1", 1), PartitionOwners(second, "broker-2", 2)
        b.advertise("grpc://10.0.0.2:6651")
        inserted, refused = threading.Event(), []

        def broker_a() -> None:
            inserted.wait(scaled(30))
            try:
                with first.atomic() as c:
                    a.hold(c, TOPIC, [5])
            except NotOwnerError as exc:
                refused.append(exc)

        thread = threading.Thread(target=broker_a)
        thread.start()
        with second.atomic() as c:
            b.hold(c, TOPIC, [5])
            inserted.set()
            wait_for(lambda: _waiting_on_a_lock(url), scaled(30),
                     what="broker-1's insert to wait for broker-2's")
        thread.join(scaled(30))
        assert [str(e) for e in refused] == [
            f"cannot open {TOPIC} partition 5: it is owned by broker-2 at "
            "grpc://10.0.0.2:6651 (epoch 2), not by this one (it was taken over, or this "
            "broker's claim is gone)"]
        assert a.owner_of(TOPIC, 5).broker_id == "broker-2"
    finally:
        first.close()
        second.close()


def _waiting_on_a_lock(url: str) -> bool:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                           "wait_event_type = 'Lock'").fetchone()
    return bool(row and row[0])


def test_a_broker_offloads_and_deletes_only_in_the_partitions_it_owns(tmp_path) -> None:
    """Offload, bookie-copy deletion and retention are each owner's work: a partition another
    broker owns is left alone, and a call naming its segment is refused before a file of it
    is touched."""
    store = make_store(tmp_path / "data", tierUrl=(tmp_path / "tier").as_uri())
    try:
        fill(store, entries=25, partitions=2)
        store.seal(TIER_TOPIC)
        newer = PartitionOwners(store.metadata, "broker-99", store.epoch + 1)
        newer.advertise("grpc://10.0.0.9:6651")
        newer.claim([(TIER_TOPIC, 1)])
        store.owners.renew()
        before = store.metadata.segments(TIER_TOPIC, 1)

        moved = store.offloader.offload_topic(TIER_TOPIC)
        assert moved and {s.partition for s in moved} == {0}
        store.set_retention(TIER_TOPIC, 1)  # everything is past it
        removed = store.offloader.apply_retention(TIER_TOPIC)
        assert removed and {r["partition"] for r in removed} == {0}
        plog = store.partition(TIER_TOPIC, 1)
        with pytest.raises(NotOwnerError, match="served by broker-99"):
            store.offloader.offload_segment(plog, plog.closed_segments()[0])
        assert store.metadata.segments(TIER_TOPIC, 1) == before  # not one row of it changed
        assert not list((tmp_path / "tier").rglob("*partition=1*"))
    finally:
        store.close()


def test_a_partition_taken_from_under_its_consumers_sends_them_and_a_tail_to_the_owner(
        tmp_path) -> None:
    """A Consumer and a following read attached at ``here``; then ``here`` loses partition 1
    (its lease's renewal sees it claimed by ``owner``). Their streams of it end, they reopen
    at the owner, and what is produced there after the move reaches both; ``here`` refuses
    appends to it and does not roll it over or seal it."""
    with running_log(tmp_path / "owner") as owner, running_log(tmp_path / "here") as here:
        for log in (owner, here):
            log.store.create_topic(TOPIC, 2)
        # the subscription exists at the owner too, as it would in the one metadata store
        # brokers share (here each runs its own)
        Consumer(TOPIC, "audit", broker=owner.url).close()
        with Consumer(TOPIC, "audit", broker=here.url) as consumer:
            tail = read(TOPIC, partition=1, broker=here.url)
            newer = PartitionOwners(here.store.metadata, "broker-99", here.store.epoch + 1)
            newer.advertise(owner.url)
            newer.claim([(TOPIC, 1)])
            here.store.owners.renew()  # what its lease thread does every second
            plog = here.store.partition(TOPIC, 1)
            assert plog.lost
            with pytest.raises(NotOwnerError, match="served by broker-99"):
                plog.seal()
            with pytest.raises(NotOwnerError, match="served by broker-99"):
                append(here.store, 1, ["late"], keys=[None], times=[None], topic=TOPIC)

            with Producer(TOPIC, broker=owner.url) as producer:
                producer.send_batch(pa.record_batch({"value": [b"after-0", b"after-1"]}),
                                    partition=1)
            got: list[bytes] = []
            while len(got) < 2:
                batch = consumer.receive(timeout=scaled(30))
                assert batch is not None, f"the consumer received {got} of 2"
                got += batch.column("value").to_pylist()
                consumer.ack(batch)
            assert got == [b"after-0", b"after-1"]
            tailed: list[bytes] = []
            for batch in tail:
                tailed += batch.column("value").to_pylist()
                if len(tailed) >= 2:
                    break
            tail.close()
            assert tailed == [b"after-0", b"after-1"]
        assert [s.state for s in here.store.metadata.segments(TOPIC, 1)] == \
            [SegmentState.OPEN]  # left for its owner to fence and seal
        assert not here.store.fenced.is_set()


def test_a_renewal_that_comes_in_past_the_lease_timeout_lapses_the_lease_then_rejoins(
        postgres) -> None:
    """Regression (cluster chaos: a broker host cut off past its lease, then mended, went
    on as if its lease held, its partitions taken over meanwhile): a renewal that waited
    past the lease timeout (there on a network dropping every packet, for less than the
    metadata sessions' DEAD_PEER_S; here on a row lock) succeeded late, and the lease
    thread never asked how long the lease had gone unrenewed. Now the lease lapses (the
    broker lets its partitions go) and, since that renewal went through, is taken up again
    at once (the broker serves what is still its own)."""
    import time

    import psycopg

    from tierstream.metadata.lease import Lease

    url = postgres.new_database()
    store = MetadataStore(url, hold=False)
    stopping = threading.Event()
    try:
        owners = PartitionOwners(store, "broker-1", 1)
        owners.advertise("grpc://10.0.0.1:6651")
        owners.renew()
        lease = Lease(owners, scaled(1))
        said: list[str] = []
        lease.on_lapsed.append(said.append)
        lease.on_rejoined.append(lambda: said.append("rejoined"))
        keeper = threading.Thread(target=lease.keep, args=(stopping,), daemon=True)
        with psycopg.connect(url) as blocker:  # the renewals wait on the broker's row
            blocker.execute("SELECT 1 FROM brokers WHERE broker_id='broker-1' FOR UPDATE")
            keeper.start()
            time.sleep(2 * scaled(1))  # how long the renewal is kept waiting
            blocker.rollback()
        wait_for(lambda: "rejoined" in said, timeout=scaled(10),
                 what="the lease renewed too late to lapse, then rejoin")
        assert "could not renew its lease" in said[0] and said[1:] == ["rejoined"], said
        assert not lease.lapsed
    finally:
        stopping.set()
        store.close()


def test_a_renewal_that_waited_out_an_outage_of_the_store_for_everyone_does_not_lapse_after(
        ) -> None:
    """Regression (the cluster outage test's flake, issue 74): PostgreSQL halted past the
    lease for every broker; each served on (a shared outage). The renewal that waited the
    outage out went through once PostgreSQL was back, but counted from its start, so the
    lease was at once "unrenewed for 15.5 s": the watch asked the peers, which had renewed
    too, and every broker let its partitions go 0.2 s after PostgreSQL came back. A
    renewal's heartbeat is written after the session it went through was opened: the
    lease now counts from then."""
    import time

    from tierstream.metadata.lease import Lease

    from ..postgres import started

    server = started()  # a server of its own: it is halted
    stopping = threading.Event()
    away = threading.Event()
    store = None
    try:
        url = server.new_database()
        store = MetadataStore(url, hold=False)
        owners = PartitionOwners(store, "broker-1", 1)
        owners.advertise("grpc://10.0.0.1:6651")
        owners.renew()
        lease = Lease(owners, scaled(3))
        lease.everyone_away = away.is_set  # the other brokers cannot reach it either
        said: list[str] = []
        lease.on_lapsed.append(said.append)
        keeper = threading.Thread(target=lease.keep, args=(stopping,), daemon=True)
        keeper.start()

        def watch() -> None:  # as broker/cluster/lease_watch.py does, four times a period
            while not stopping.wait(0.05):
                lease.lapse_if_due()
        threading.Thread(target=watch, daemon=True).start()
        away.set()
        server.halt()
        time.sleep(2 * scaled(3))  # past the lease: a shared outage, nobody lapses
        assert said == [] and owners.shared_outage
        server.resume()
        away.clear()  # the others renew as soon as it is back
        wait_for(lambda: not owners.shared_outage and owners.renewing(),
                 timeout=scaled(30), what="the renewal to go through")
        time.sleep(scaled(2))  # the watch looks some 40 times meanwhile
        assert said == [], said
    finally:
        stopping.set()
        if store is not None:
            store.close()
        server.stop()
