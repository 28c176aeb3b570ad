"""Several brokers (issue 52), continued from ``test_cluster.py`` (kept apart so that
the two files run on two test workers): refusals past a producer's send timeout, drains of
partitions not opened yet, offload and repair by each partition's owner, and topic stats
gathered from every owner."""

from __future__ import annotations

import signal
import threading
import time

import pyarrow as pa
import pytest

from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import UnavailableError
from tierstream.model.positions import Offset

from ..cli.test_cli import run
from ..ports import fixed_port
from ..timing import scaled
from .helpers import read_all, stop_process, wait_for
from .test_cluster import _cluster, _owned, _Received, _spread
from .test_cluster_transactions import _paused_at
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order


def test_a_producer_refused_past_its_send_timeout_gives_up_naming_the_batches(
        network_store) -> None:
    """Partition 1 is owned by a broker that renews its lease but never said where it is
    reached: the broker asked refuses every batch, with no address to follow. The producer
    gives up once its send_timeout passed without an ack, naming the batches in doubt; it
    retried for good before (the loop was only ended by a pytest timeout under load)."""
    from tierstream.metadata.ownership import PartitionOwners
    from tierstream.metadata.store import MetadataStore

    url, _, broker = network_store
    a = _cluster(broker, "broker-a", "--lease-timeout", "1h").start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 2)
    metadata = MetadataStore(url, hold=False)
    try:
        ghost = PartitionOwners(metadata, "broker-ghost", 10**6)
        ghost.join()  # alive, and reached nowhere
        ghost.claim([(TOPIC, 1)])
        wait_for(lambda: any("lost 1 partition(s) to other brokers" in line
                             for line in a.stderr_tail), timeout=scaled(30),
                 what="broker A's renewal to see partition 1 owned by the ghost")
        failed: list[BaseException] = []

        def send() -> None:
            try:
                with Producer(TOPIC, broker=a.url, send_timeout=scaled(2)) as producer:
                    producer.send_batch(pa.record_batch({"value": [b"v"]}), partition=1)
                    producer.flush()
            except BaseException as exc:  # what the test checks
                failed.append(exc)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(scaled(60))
        assert not thread.is_alive(), "the producer retried for good"
        assert len(failed) == 1 and isinstance(failed[0], UnavailableError), failed
        said = str(failed[0])
        assert "kept refusing it" in said and "served by broker-ghost" in said, said
        assert failed[0].unacknowledged == {1: [0]}  # type: ignore[attr-defined]
    finally:
        metadata.close()


def test_a_drain_moves_a_partition_handed_to_the_broker_but_not_opened_yet(
        network_store) -> None:
    """A partition unloaded to B is B's at once, but B opens it only when a client names it
    or at its next renewal. Drained before that, B moves it on too: a drain moves what the
    broker owns, not only what it has opened (it left such a partition behind)."""
    _, _, broker = network_store
    a, b = (_cluster(broker, f"broker-{n}", "--lease-timeout", "1h").start() for n in "ab")
    _spread((a, b), 2)
    with Admin(a.url) as admin_a, Admin(b.url) as admin_b:
        mine = [p["partition"] for p in admin_a.topic_stats(TOPIC, per_partition=True)
                ["partitions"]]
        assert len(admin_a.unload(TOPIC, mine[0])) == 1
        moved = admin_b.drain()  # at once: B has not opened the partition yet
    assert sorted(moved) == [f"{TOPIC}/0", f"{TOPIC}/1"], moved
    assert [_owned(x.url) for x in (a, b)] == [2, 0]
    with Producer(TOPIC, broker=a.url) as producer:
        acks = producer.send_many({"key": f"k{i}", "value": f"k{i}:{i}".encode()}
                                  for i in range(20))
    assert {ack["partition"] for ack in acks} == {0, 1}
    check_exactly_once_in_order(_read(a.url), 20)


def test_a_partition_taken_over_then_handed_to_an_older_broker_is_offloaded_there(
        network_store) -> None:
    """B is SIGKILLed and its partition taken over at a new epoch, which fences B's open
    ledger at that epoch on its bookies. The taker is drained to the broker that started
    before the takeover (an older epoch). That broker offloads the partition and deletes its
    bookie copies, the fenced ledger's too. (Regression: the bookies refused that delete as
    of an epoch older than the fence, so the copies stayed and every pass failed.)"""
    _, _, broker = network_store
    a, b, c = (_cluster(broker, f"broker-{n}", "--deletion-lag", "0s").start() for n in "abc")
    _spread((a, b, c), 3)
    writer = _Writer(f"{a.url},{c.url}", send_timeout=scaled(30))
    try:
        writer.wait_for_more(300)
        b.kill()  # its open ledger is fenced by the taker's recovery
        wait_for(lambda: _owned(a.url) + _owned(c.url) == 3, timeout=scaled(60),
                 what="A or C to take B's partition over")
        writer.wait_for_more(300)
    finally:
        acked = writer.stop()
    taker, older = (a, c) if _owned(a.url) == 2 else (c, a)
    with Admin(taker.url) as admin:
        admin.drain()
    assert _owned(older.url) == 3

    def served() -> int:  # opened at its next renewal: until then its view names the taker
        with Admin(older.url) as admin:
            return int(admin.stats()["partitions"])

    wait_for(lambda: served() == 3, timeout=scaled(30), what="the older broker to open the 3")
    with Admin(older.url) as admin:
        admin.seal(TOPIC)
        admin.offload(TOPIC)
        segments = [s for s in admin.list_segments(TOPIC) if s.state == "CLOSED"]
    assert segments and all(s.tier_url and s.bookie_deleted_at for s in segments), segments
    check_exactly_once_in_order(_read(older.url), acked)


def test_a_topic_s_stats_asked_of_any_broker_count_every_owner_s_partitions(
        network_store) -> None:
    """A 6-partition topic owned 2/2/2 by three brokers, written through one. Its stats asked
    of A count every partition (A asks B and C for theirs), in tierstream's view and in the
    Pulsar admin REST's: a partition's, a partitioned topic's. With C paused, A's answer
    still comes, naming C's partitions as not counted, and ``topic stats`` says so."""
    import json
    import urllib.request

    from tierstream.broker.peers import PEER_TIMEOUT_S

    _, _, broker = network_store
    # a long lease: C stays the owner of its partitions while it is paused
    brokers = [broker(f"broker-{n}", "--cluster", "--lease-timeout", f"{scaled(30):g}s",
                      "--admin-port", str(fixed_port())).start() for n in "abc"]
    a, _, c = brokers
    _spread(brokers, 6)
    Consumer(TOPIC, "audit", broker=a.url).close()  # a subscription of every partition
    with Producer(TOPIC, broker=a.url) as producer:  # each partition written at its owner
        producer.send_many({"key": f"k{i % 7}", "value": f"k{i % 7}:{i}".encode()}
                           for i in range(600))
        producer.flush()
    with Admin(a.url) as admin:
        stats = admin.topic_stats(TOPIC, per_partition=True)
        me = admin.stats()["broker"]["id"]
    stored = sum(loc["messages"] for loc in stats["storage"].values())
    assert (stored, stats["subscriptions"]["audit"]["backlog"], stats.get("unanswered")) == \
        (600, 600, []), stats
    assert [p["partition"] for p in stats["partitions"]] == list(range(6))
    assert sum(p["messages_in"] for p in stats["partitions"]) == 600
    mine = max(p["partition"] for p in stats["partitions"] if p["owner"]["broker"] == me)
    rest = f"{a.admin_url}/admin/v2/persistent/{TOPIC}"
    with urllib.request.urlopen(f"{rest}-partition-{mine}/stats",
                                timeout=scaled(30)) as answer:
        one = json.load(answer)
    assert one["msgInCounter"] == stats["partitions"][mine]["messages_in"] > 0
    assert one["subscriptions"]["audit"]["msgBacklog"] == one["msgInCounter"]
    with urllib.request.urlopen(f"{rest}/partitioned-stats?perPartition=true",
                                timeout=scaled(30)) as answer:
        whole = json.load(answer)
    assert (whole["metadata"]["partitions"], len(whole["partitions"]),
            whole["subscriptions"]["audit"]["msgBacklog"]) == (6, 6, 600)
    assert c.proc is not None
    stop_process(c.proc.pid)
    try:
        began = time.monotonic()
        with Admin(a.url) as admin:
            stats = admin.topic_stats(TOPIC)
        assert time.monotonic() - began < PEER_TIMEOUT_S + scaled(15)
        theirs = [g for g in stats["unanswered"] if g["broker"] != me]
        assert len(theirs) == 1 and len(theirs[0]["partitions"]) == 2, stats["unanswered"]
        assert "did not answer in time" in theirs[0]["reason"]
        assert sum(loc["messages"] for loc in stats["storage"].values()) < 600
        said = run("topic", "stats", TOPIC, "--broker", a.url)
        assert said.returncode == 0, said.stderr
        numbers = ", ".join(map(str, theirs[0]["partitions"]))
        assert f"not counted: partition(s) {numbers} (owned by {theirs[0]['broker']})" in \
            " ".join(said.stdout.split()), said.stdout
    finally:
        c.proc.send_signal(signal.SIGCONT)


def test_each_broker_repairs_the_segments_of_its_own_partitions_and_its_log_knows_it(
        network_store) -> None:
    """Two brokers own a partition each, their segments written on two of three bookies. A
    bookie both partitions write to is SIGKILLed under a producer: each open segment is
    sealed without it and re-replicated onto the third bookie by its partition's owner,
    whose log then names the new bookies. (Every broker repaired every partition's segments
    before: the owner of one another broker had repaired went on naming the dead bookie to
    readers, to its offload and to its deletions, which left the new copy behind for
    good.)"""
    _, bookies, broker = network_store
    brokers = [_cluster(broker, f"broker-{n}", "--write-quorum", "2", "--ack-quorum",
                        "2").start() for n in "ab"]
    _spread(brokers, 2)

    def ensembles(url: str, state: str) -> list[tuple[str, ...]]:  # as the owner's log has
        with Admin(url) as admin:
            return [s.ensemble for s in admin.list_segments(TOPIC)
                    if s.state == state and s.entries]

    writer = _Writer(",".join(b.url for b in brokers), send_timeout=scaled(30))
    try:
        writer.wait_for_more(500)
        both = set.intersection(*(set(ensembles(b.url, "OPEN")[0]) for b in brokers))
        victim = sorted(both)[0]  # two of three bookies each: they share one at least
        bookies[int(victim.rsplit("-", 1)[1])].kill()
        writer.wait_for_more(500)  # on new segments, without it
    finally:
        acked = writer.stop()
    for b in brokers:
        wait_for(lambda url=b.url: all(victim not in e for e in ensembles(url, "CLOSED")),
                 timeout=scaled(60), what=f"{b.data_dir.name}'s log to name the bookies its "
                 f"segments were re-replicated onto, not {victim}")
        with Admin(b.url) as admin:  # it repaired its own
            assert admin.stats()["replication"]["re_replicated"] > 0, b.data_dir.name
    check_exactly_once_in_order(_read(brokers[0].url), acked)


def test_a_topic_spread_over_three_brokers_grows_under_a_producer_and_a_consumer(
        network_store) -> None:
    """``topic set --partitions`` on a cluster: a 6-partition topic, 2 on each of three
    brokers, grows to 12 under a producer given every broker. The broker asked gathers the
    partitions from their owners and records the scale event; it serves all 12 then, and no
    broker stops. Every acknowledged message is read once in key order, and received by a
    key_shared consumer in key order, and nothing is routed by the old count after the
    event. (The consumer missed some keys' later messages in about 1 run of 4 on a loaded
    machine: acks said stored by a broker that had just handed their partition over, and
    new partitions opened twice; see the two tests below.)"""
    from .test_elastic_topics import misrouted

    _, _, broker = network_store
    brokers = [_cluster(broker, f"broker-{n}").start() for n in "abc"]
    a, b, c = brokers
    _spread(brokers, 6)
    received = _Received(f"{c.url},{a.url}")
    writer = _Writer(f"{a.url},{b.url},{c.url}", send_timeout=scaled(30))
    try:
        writer.wait_for_more(500)
        said = run("topic", "set", TOPIC, "--partitions", "12", "--broker", b.url)
        assert said.returncode == 0, said.stderr
        assert [_owned(x.url) for x in brokers] == [0, 12, 0]
        writer.wait_for_more(500)
    finally:
        acked = writer.stop()
    received.check(acked)
    stopped = {x.url: "".join(list(x.stderr_tail)[-20:]) for x in brokers
               if x.proc is not None and x.proc.poll() is not None}
    assert stopped == {}, stopped  # no broker stops
    with Admin(a.url) as admin:
        record = admin.get_topic(TOPIC)
    assert record.partitions == 12 and [(e.old, e.new) for e in record.scale_events] == \
        [(6, 12)]
    table = read_all(a.url, TOPIC)
    check_exactly_once_in_order([bytes(v).decode() for v in table.column("value")
                                 .to_pylist()], acked)
    assert not misrouted(table, record)
    assert all(x.tracebacks == [] for x in brokers)


def test_a_growth_slowed_between_its_record_and_its_open_opens_its_partitions_once(
        network_store) -> None:
    """A scale event's new partitions are the growing broker's from its metadata commit, and
    the growth opens them a moment later. A renewal in that moment took them for partitions
    placed on the broker and opened them a second time: it recovered (dropped) the open
    segments the growth had just made and replaced the partition logs a consumer had
    attached to, which then never delivered again. A broker paused there
    (``TIERSTREAM_PAUSE_AT=scale.recorded``, past a renewal) opens them once, and a
    key_shared consumer receives every acknowledged message, once, in key order."""
    from tierstream.util.faults import PAUSE_ENV, PAUSE_S_ENV

    _, _, broker = network_store
    a = _cluster(broker, "broker-a")
    a.env = {PAUSE_ENV: "scale.recorded", PAUSE_S_ENV: f"{scaled(3):g}"}  # the lease's
    a.start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 2)
    received = _Received(a.url)
    writer = _Writer(a.url, send_timeout=scaled(30))
    try:
        writer.wait_for_more(300)
        said = run("topic", "set", TOPIC, "--partitions", "4", "--broker", a.url)
        assert said.returncode == 0, said.stderr
        writer.wait_for_more(300)
    finally:
        acked = writer.stop()
    received.check(acked)
    check_exactly_once_in_order(_read(a.url), acked)
    log = "".join(a.stderr_tail)
    assert "placed on it" not in log and "dropped empty segment" not in log, log[-3000:]


def test_an_ack_taken_as_its_partition_moved_is_stored_by_the_new_owner(
        network_store) -> None:
    """Broker A takes an ack (in memory), and its cursor's commit waits (``cursor.writing``
    paused) while the partition moves to B; A's commit leaves that cursor out, as B owns it
    now. A answered the ack as stored, and the consumer, which had re-attached to B
    meanwhile, dropped B's copies of those messages as acknowledged: nobody acknowledged
    them at B, ever (a key_shared key behind them waited for good). A refuses such an ack
    now, naming B, and the client sends it there."""
    from tierstream.util.faults import PAUSE_ENV, PAUSE_S_ENV

    _, _, broker = network_store
    a = _cluster(broker, "broker-a")  # its second cursor commit (the first is the attach)
    a.env = {PAUSE_ENV: "cursor.writing@2", PAUSE_S_ENV: f"{scaled(5):g}"}
    a.start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 1)
    b = _cluster(broker, "broker-b").start()
    with Producer(TOPIC, broker=a.url) as producer:
        producer.send_many({"key": f"k{i}", "value": f"k{i}:{i}".encode()} for i in range(10))

    def backlog(url: str) -> int:
        with Admin(url) as admin:
            return sum(int(row["backlog"]) for row in admin.subscriptions(TOPIC))

    outcome: list[BaseException | None] = []
    with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(),
                  broker=f"{a.url},{b.url}") as consumer:
        batch = consumer.receive(timeout=scaled(30))
        assert batch is not None and batch.num_rows == 10

        def ack() -> None:
            try:
                consumer.ack(batch)
                outcome.append(None)
            except BaseException as exc:  # asserted below
                outcome.append(exc)

        acking = threading.Thread(target=ack, daemon=True)
        acking.start()
        wait_for(lambda: backlog(a.url) == 0, timeout=scaled(30),
                 what="broker A to take the ack (its commit paused)")
        with Admin(a.url) as admin:
            assert list(admin.unload(TOPIC, 0)) == [f"{TOPIC}/0"]  # to B
        acking.join(scaled(60))
        assert outcome == [None], outcome
        wait_for(lambda: backlog(b.url) == 0, timeout=scaled(30),
                 what="the ack to be stored by broker B, the partition's owner now")


def test_a_grown_partition_moved_away_holds_a_key_until_its_parent_s_owner_says_acked(
        network_store) -> None:
    """A key_shared subscription holds a key's messages in a new partition until those
    before the scale event in its parent are acknowledged. The new partition moves to B,
    its parent stays on A: B asks A, and holds while the consumer holds the parent's
    messages unacknowledged, then delivers once they are acknowledged. (B read the parent's
    log, which it does not have: the gate raised in B's subscription timer, and nothing of
    the new partition was ever delivered.)"""
    _, _, broker = network_store
    a, b = (_cluster(broker, f"broker-{n}", "--lease-timeout", "1h").start() for n in "ab")
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 1)  # on A: the least loaded, first
    keys = [f"k{i}" for i in range(20)]

    def send(first: int) -> None:
        with Producer(TOPIC, broker=a.url) as producer:
            producer.send_many({"key": k, "value": f"{k}:{first + i}".encode()}
                               for i, k in enumerate(keys))

    send(0)
    with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(),
                  broker=f"{a.url},{b.url}") as consumer:
        held = consumer.receive(timeout=scaled(30))  # not acknowledged yet
        assert held is not None and held.num_rows == 20
        with Admin(a.url) as admin:
            admin.set_partitions(TOPIC, 2)
            send(20)
            assert list(admin.unload(TOPIC, 1)) == [f"{TOPIC}/1"]  # to B; 0 stays on A
        assert (_owned(a.url), _owned(b.url)) == (1, 1)
        values: list[str] = []

        def take(until: float) -> None:
            while time.monotonic() < until:
                batch = consumer.receive(timeout=0.2)
                if batch is not None:
                    values.extend(bytes(v).decode() for v in batch.column("value").to_pylist())
                    consumer.ack(batch)

        table = read_all(a.url, TOPIC)
        one = {bytes(v).decode() for v, p in zip(table.column("value").to_pylist(),
                                                  table.column("partition").to_pylist(),
                                                  strict=True) if p == 1}
        stayed = {f"{k}:{20 + i}" for i, k in enumerate(keys)} - one
        assert one and stayed, one  # some keys went to the new partition, some stayed
        wait_for(lambda: take(time.monotonic() + 0.5) or stayed <= set(values),
                 timeout=scaled(30), what="partition 0's messages after the event")
        take(time.monotonic() + scaled(1))  # partition 1's would have come by now
        assert not one & set(values), "a key's messages came before its earlier ones were acked"
        consumer.ack(held)
        wait_for(lambda: take(time.monotonic() + 0.5) or one <= set(values),
                 timeout=scaled(30), what="partition 1's messages, once its parent's are acked")
    assert sorted(int(v.split(":")[1]) for v in values) == list(range(20, 40))


@pytest.mark.parametrize("move", ["unload", "kill"])
def test_a_topic_its_pulsar_clients_route_grows_on_two_brokers_in_two_steps(
        network_store, move: str) -> None:
    """A topic whose keys the real pulsar-client routes (its default hash), spread over two
    cluster brokers, grows 2 -> 4 (it was refused on a cluster): B gathers A's partition
    and announces the new count; a client that looked again writes to the new partitions
    at once, one that has not routes by 2. Between the steps, partition 1 is unloaded to A
    (so B, serving partition 0 when the clients' wait is over, gathers it again and records
    the event), or B is SIGKILLed (A takes every partition over, the new ones too, and
    records it). Every message once, each key in the order sent, read back and received by a
    key_shared consumer of the real client; no other broker stops."""
    import pulsar

    from tierstream import read

    from ..elastic import Written, order_errors
    from ..pulsar_wire.helpers import client_of

    _, _, broker = network_store
    wait = f"{round(scaled(6) * 1000)}ms"
    a, b = brokers = [_cluster(broker, f"broker-{n}", "--pulsar-port", str(fixed_port()),
                               "--client-refresh-wait", wait).start() for n in "ab"]
    _spread(brokers, 2)
    name = f"persistent://{TOPIC}"
    written = Written(counts=[2, 4])
    where: dict[str, int] = {}

    def send(producer: object, phase: str) -> None:
        for i in range(60):
            key = f"user-{i % 12}"
            value = f"{key}|{phase}{i:03d}"
            written.by_key[key].append(value)
            where[value] = producer.send(  # type: ignore[attr-defined]
                value.encode(), partition_key=key).partition()

    timeout = int(scaled(60) * 1000)
    old, new = client_of(a), client_of(a if move == "kill" else b)
    try:
        stale = old.create_producer(name, batching_enabled=False, send_timeout_millis=timeout)
        send(stale, "a")
        with Admin(a.url) as admin:
            assert admin.get_topic(TOPIC).key_routing == "client"
        said = run("topic", "set", TOPIC, "--partitions", "4", "--broker", b.url)
        assert said.returncode == 0, said.stderr
        with Admin(b.url) as admin:
            grown = admin.get_topic(TOPIC)
            assert (grown.partitions, grown.announced) == (2, 4)
            if move == "unload":
                assert list(admin.unload(TOPIC, 1)) == [f"{TOPIC}/1"]  # to A
        if move == "kill":
            b.kill()
        send(stale, "b")
        assert {where[v] for v in where if "|b" in v} == {0, 1}  # it has not looked again
        # a key_shared consumer of the real client, subscribed during the announcement: a
        # new partition's messages come after their parents' from before the event
        consumer = new.subscribe(name, "pulsar-ks", consumer_type=pulsar.ConsumerType.KeyShared,
                                 initial_position=pulsar.InitialPosition.Earliest)
        fresh = new.create_producer(name, batching_enabled=False, send_timeout_millis=timeout)
        send(fresh, "c")
        assert {where[v] for v in where if "|c" in v} & {2, 3}  # routed by 4
        with Admin(a.url) as admin:
            wait_for(lambda: admin.get_topic(TOPIC).partitions == 4, timeout=scaled(60),
                     what="the announced growth to be recorded")
            assert admin.get_topic(TOPIC).scale_events[-1].new == 4
        send(fresh, "d")
        # each message at least once (a partition that moves redelivers what was not
        # acknowledged there yet), each key's messages in order at their first delivery
        got: dict[str, dict[str, None]] = {}
        until = time.monotonic() + scaled(60)
        while sum(map(len, got.values())) < written.total and time.monotonic() < until:
            try:
                msg = consumer.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            got.setdefault(msg.partition_key(), {})[msg.data().decode()] = None
            consumer.acknowledge(msg)
        assert {k: list(v) for k, v in got.items()} == dict(written.by_key)
    finally:
        old.close()
        new.close()
    table = read(TOPIC, broker=a.url)
    assert order_errors(written, table.column("key").to_pylist(),
                        table.column("value").to_pylist()) == []
    assert a.proc is not None and a.proc.poll() is None and a.tracebacks == []
    said = "".join(a.stderr_tail)
    if move == "unload":  # B gathered partition 1 back from A to record the event
        assert b.proc is not None and b.proc.poll() is None and b.tracebacks == []
        assert f"moved 1 partition(s) to other brokers: {TOPIC} partition 1" in said
    else:
        assert "took over 4 partition(s)" in said and "scale event 1: 2 -> 4" in said, said


def test_a_busy_topic_spread_over_two_brokers_grows_by_itself(network_store) -> None:
    """``--auto-scale-rate`` on cluster brokers (it was refused): a 2-partition topic placed
    one partition on each broker, both partitions busy. The broker serving partition 0
    judges the topic with the other owner's count, doubles it (gathering the other
    partition first), and every acknowledged message is read once, in key order."""
    _, _, broker = network_store
    a, b = brokers = [_cluster(broker, f"broker-{n}", "--auto-scale-rate", "50",
                               "--auto-scale-window", "2s").start() for n in "ab"]
    _spread(brokers, 2)
    writer = _Writer(f"{a.url},{b.url}", send_timeout=scaled(30))
    try:
        with Admin(a.url) as admin:
            wait_for(lambda: admin.get_topic(TOPIC).partitions == 4, timeout=scaled(60),
                     what="the busy topic to grow by itself")
            event = admin.get_topic(TOPIC).scale_events[0]
        writer.wait_for_more(300)
    finally:
        acked = writer.stop()
    assert (event.old, event.new) == (2, 4)
    assert event.reason.startswith("auto-scale: every partition above 50 msg/s"), event.reason
    check_exactly_once_in_order(_read(b.url), acked)
    assert all(x.proc is not None and x.proc.poll() is None for x in brokers)
    assert a.tracebacks == [] and b.tracebacks == []


def test_a_consumer_attaching_as_its_partition_moves_follows_it_to_the_new_owner(
        network_store) -> None:
    """A consumer's stream finds its partition served at A, and waits before it attaches
    (``consumer.attaching`` paused) while A unloads the partition to B. A attached it all
    the same, to a partition it served no more: the stream stayed open and idle, and no
    message produced at B ever reached the consumer (cluster_chaos under load: two of twelve
    partitions' 2,802 messages, never delivered after a drain). Now A refuses the attach,
    naming B, and the consumer receives every message there, in key order."""
    _, _, broker = network_store
    # the second attach waits (the first makes the cursor)
    a = _paused_at(broker, "broker-a", "consumer.attaching@2", scaled(3))
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 1)
    b = _cluster(broker, "broker-b").start()
    with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(), broker=a.url):
        pass  # the subscription exists from here on: an attach then writes nothing
    received = _Received(f"{a.url},{b.url}")
    wait_for(lambda: "pause point consumer.attaching" in "".join(a.stderr_tail),
             timeout=scaled(30), what="the consumer's attach to wait at broker A")
    with Admin(a.url) as admin:
        assert list(admin.unload(TOPIC, 0)) == [f"{TOPIC}/0"]  # to B, while it waits
    with Producer(TOPIC, broker=f"{b.url},{a.url}") as producer:
        producer.send_many({"key": f"k{i % 7}", "value": f"k{i % 7}:{i}".encode()}
                           for i in range(50))
    received.check(50)
    assert a.tracebacks == [] and b.tracebacks == []
