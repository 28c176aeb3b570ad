"""Several brokers serving one store at once (``broker start --cluster``,
broker/cluster/membership.py):
real broker processes, network bookies and PostgreSQL on loopback."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import ConfigError, NotFoundError, TierstreamError
from tierstream.model.positions import Offset

from ..cli.test_cli import run
from ..ports import fixed_port
from ..timing import scaled
from .helpers import stop_process, wait_for
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order


def _cluster(broker: Callable[..., BrokerProcess], name: str, *extra: str) -> BrokerProcess:
    return broker(name, "--cluster", "--lease-timeout", f"{scaled(3):g}s", *extra)


def _owned(url: str) -> int:
    with Admin(url) as admin:
        return int(admin.stats()["broker"]["partitions_owned"])


def _spread(brokers: Sequence[BrokerProcess], partitions: int) -> None:
    """Create TOPIC with ``partitions`` at the first of ``brokers``, and wait until each
    owns as many (placement by count: the others open theirs at their next renewal)."""
    with Admin(brokers[0].url) as admin:
        admin.create_topic(TOPIC, partitions)
    share = partitions // len(brokers)
    wait_for(lambda: [_owned(b.url) for b in brokers] == [share] * len(brokers),
             timeout=scaled(30), what=f"the {partitions} partitions to be owned {share} by "
             "each broker")


class _Received:
    """A key_shared ``Consumer`` of ``broker`` on a thread of its own, receiving and
    acknowledging until :meth:`check`."""

    def __init__(self, broker: str) -> None:
        self.broker = broker
        self.values: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(broker,), daemon=True)
        self._thread.start()

    def _run(self, broker: str) -> None:
        try:
            with Consumer(TOPIC, "audit", mode="key_shared", initial=Offset.earliest(),
                          broker=broker) as consumer:
                while not self._stop.is_set():
                    batch = consumer.receive(timeout=0.2)
                    if batch is not None:
                        self.values.extend(bytes(v).decode()
                                           for v in batch.column("value").to_pylist())
                        consumer.ack(batch)
        except BaseException as exc:  # reported by check()
            self.errors.append(exc)

    def check(self, acked: int) -> None:
        """Every acknowledged message received, every key in order (where each came first:
        a redelivery after a move starts over from the last acknowledgement stored)."""
        try:
            wait_for(lambda: bool(self.errors) or set(range(acked)) <= {
                int(v.split(":")[1]) for v in list(self.values)}, timeout=scaled(60),
                     what="the consumer to receive every message acknowledged")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self._stalled(acked)}") from None
        self._stop.set()
        self._thread.join(scaled(30))
        assert not self.errors, self.errors
        check_exactly_once_in_order(list(dict.fromkeys(self.values)), acked)

    def _stalled(self, acked: int) -> str:
        """What a stalled consumer left: how many messages it misses, and each partition
        with a backlog as its owner lists it, with the consumers attached there (a
        partition's pump attached nowhere, or somewhere that delivers nothing, shows as a
        backlog and no consumer)."""
        missing = sorted(set(range(acked)) - {int(v.split(":")[1]) for v in list(self.values)})
        said = [f"{len(missing)} missing (first {missing[:5]})"]
        for url in self.broker.split(","):
            try:
                with Admin(url) as admin:
                    rows = admin.subscriptions(TOPIC)
            except TierstreamError as exc:
                said.append(f"{url}: {exc}")
                continue
            said += [f"{url}: partition {r['partition']} backlog {r['backlog']}, consumers "
                     f"{[c['name'] for c in r['consumers']]}" for r in rows if r["backlog"]]
        return "; ".join(said)


def test_a_cluster_broker_takes_over_the_partitions_of_one_killed_under_load(
        network_store) -> None:
    """Broker A serves a 4-partition topic under a producer given both brokers; A is
    SIGKILLed. Once A's lease expired, B takes its partitions over (fencing and recovering
    their open segments at a new epoch), the producer goes on through B, and every
    acknowledged message is read back once, in key order."""
    _, _, broker = network_store
    a = _cluster(broker, "broker-a").start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 4)
    b = _cluster(broker, "broker-b").start()
    assert (_owned(a.url), _owned(b.url)) == (4, 0)  # a live owner keeps its partitions
    writer = _Writer(f"{b.url},{a.url}", send_timeout=scaled(30))
    try:
        writer.wait_for_more(1_000)
        a.kill()
        writer.wait_for_more(1_000)  # through B, once it took the partitions over
    finally:
        acked = writer.stop()
    assert _owned(b.url) == 4
    check_exactly_once_in_order(_read(b.url), acked)
    with Admin(b.url) as admin:
        stats = admin.stats()
    brokers = {row["broker"]: row for row in stats["brokers"]}
    me = stats["broker"]["id"]
    assert brokers[me]["partitions"] == 4 and brokers[me]["this"]
    assert all(row["partitions"] == 0 for k, row in brokers.items() if k != me)
    assert b.tracebacks == []
    said = "\n".join(b.stderr_tail)
    assert "took over 4 partition(s) whose owner's lease expired" in said, said


def test_a_topic_is_spread_over_the_live_brokers_and_a_killed_one_s_share_over_the_rest(
        network_store) -> None:
    """Three cluster brokers; a 12-partition topic created at A is placed 4 on each (the
    others open theirs at their next renewal). A producer given A and B writes every
    partition at its owner. C is SIGKILLed: A and B take its 4 over, 2 each, and every
    acknowledged message is read back once, in key order."""
    _, _, broker = network_store
    brokers = [_cluster(broker, f"broker-{n}").start() for n in "abc"]
    a, b, c = brokers
    _spread(brokers, 12)
    Consumer(TOPIC, "audit", broker=a.url).close()  # a subscription of every partition
    with Admin(b.url) as admin:  # any broker says who owns what
        stats = admin.topic_stats(TOPIC, per_partition=True)
    owners = {o["broker"]: o["partitions"] for o in stats["owners"]}
    assert sorted(owners.values()) == [4, 4, 4], owners
    # every partition, each with its subscription: B asked the others' of their owners
    assert [p["partition"] for p in stats["partitions"] if p["subscriptions"]] == \
        list(range(12)), stats.get("unanswered")
    writer = _Writer(f"{a.url},{b.url}", send_timeout=scaled(30))
    try:
        writer.wait_for_more(1_000)
        c.kill()
        wait_for(lambda: [_owned(x.url) for x in (a, b)] == [6, 6], timeout=scaled(60),
                 what="C's partitions to be taken over, 2 by A and 2 by B")
        writer.wait_for_more(1_000)
    finally:
        acked = writer.stop()
    check_exactly_once_in_order(_read(a.url), acked)


def test_a_broker_paused_past_its_lease_is_taken_over_then_rejoins_owning_nothing(
        network_store) -> None:
    """A and B share a 4-partition topic (2 each) under a producer and a key_shared consumer
    given both. A is SIGSTOPped past its lease: B takes A's partitions over, and producer and
    consumer go on through B. A resumed finds its lease lapsed, lets go of what it served
    (it stored nothing more), says why, and rejoins owning nothing: a producer that names
    only A is sent to B. Every acknowledged message is read back once in key order, and the
    consumer received each one, every key in order (a redelivery after the move starts over
    from the last acknowledgement B has)."""
    _, _, broker = network_store
    a, b = (_cluster(broker, f"broker-{n}").start() for n in "ab")
    _spread((a, b), 4)
    both = f"{b.url},{a.url}"
    received = _Received(both)
    # a producer leaves the partition's owner after this long without an ack (it hangs)
    writer = _Writer(both, send_timeout=scaled(5))
    try:
        writer.wait_for_more(1_000)
        assert a.proc is not None
        stop_process(a.proc.pid)
        wait_for(lambda: _owned(b.url) == 4, timeout=scaled(60),
                 what="broker B to take over the partitions of the paused broker A")
        writer.wait_for_more(1_000)
    finally:
        acked = writer.stop()
    a.proc.send_signal(signal.SIGCONT)  # its lease lapsed: it lets go, then rejoins
    wait_for(lambda: "renews its lease again" in "".join(a.stderr_tail), timeout=scaled(60),
             what="broker A to rejoin")
    with Producer(TOPIC, broker=a.url, name="late", batch_size=10,
                  send_timeout=scaled(30)) as late:
        # numbered past the writer's (the consumer's check reads every value's number)
        late.send_many([{"key": "k0", "value": f"late:{10**6 + i}".encode()}
                        for i in range(50)])
    assert a.proc.poll() is None, "broker A stopped"
    assert _owned(a.url) == 0
    said = "".join(a.stderr_tail)
    assert "could not renew its lease" in said and "Traceback" not in said, said[-3000:]
    values = _read(b.url)
    assert sorted(v for v in values if v.startswith("late")) == \
        sorted(f"late:{10**6 + i}" for i in range(50)), "the late writes, once each, by B"
    check_exactly_once_in_order([v for v in values if not v.startswith("late")], acked)

    received.check(acked)


def test_a_producer_leaves_a_hung_owner_that_is_also_the_broker_it_uses(
        network_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer given C, A and B followed A's partitions there. C is killed: the producer
    goes on through A, which is now both the owner it follows and the broker it uses. A
    hangs: once a send timeout passed without an ack, the producer leaves A for B (which
    took everything over) rather than going back to A and giving up (cluster chaos found
    that: "gave up ... broker A connected but sent no ack"), with every stream A had."""
    _, _, broker = network_store
    send_timeout = scaled(5)
    # a second stall at A would outlast the reconnect window: the producer would give up
    monkeypatch.setenv("TIERSTREAM_RECONNECT_TIMEOUT", f"{send_timeout / 2:g}s")
    a, b, c = (_cluster(broker, f"broker-{n}").start() for n in "abc")
    _spread((a, b, c), 6)
    writer = _Writer(f"{c.url},{a.url},{b.url}", send_timeout=send_timeout)
    try:
        writer.wait_for_more(500)
        c.kill()
        wait_for(lambda: _owned(a.url) + _owned(b.url) == 6, timeout=scaled(60),
                 what="A and B to take over C's partitions")
        writer.wait_for_more(500)  # through A now
        assert a.proc is not None
        paused = time.monotonic()
        stop_process(a.proc.pid)
        wait_for(lambda: _owned(b.url) == 6, timeout=scaled(60),
                 what="B to take over the partitions of the paused broker A")
        writer.wait_for_more(500)
        # one send timeout finds A hung, and every stream to A leaves it then (each of A's
        # partitions used to wait out a send timeout of its own, one after another)
        resumed = time.monotonic() - paused
        assert resumed < 2 * send_timeout, f"acks again {resumed:.1f} s after A hung"
    finally:
        acked = writer.stop()
    check_exactly_once_in_order(_read(b.url), acked)


def test_partitions_move_between_live_brokers_on_demand_and_their_clients_follow(
        network_store) -> None:
    """A and B share a 4-partition topic (2 each; leases of an hour: nothing expires) under
    a producer and a key_shared consumer given A only. ``topic unload`` moves one of A's
    partitions to B, then ``broker drain`` moves all of B's to A, each sealed and handed
    over. Producer and consumer follow every move; every acknowledged message is read back
    once, in key order, and received, every key in order."""
    _, _, broker = network_store
    a, b = (_cluster(broker, f"broker-{n}", "--lease-timeout", "1h").start() for n in "ab")
    _spread((a, b), 4)
    received = _Received(a.url)
    writer = _Writer(a.url, send_timeout=scaled(5))
    try:
        writer.wait_for_more(500)
        with Admin(a.url) as admin:
            mine = [p["partition"] for p in admin.topic_stats(TOPIC, per_partition=True)
                    ["partitions"]]
        moved = run("topic", "unload", f"{TOPIC}/{mine[0]}", "--broker", a.url)
        assert moved.returncode == 0, moved.stderr
        assert f"moved 1 partition(s): {TOPIC}/{mine[0]} to broker-" in moved.stdout
        assert [_owned(x.url) for x in (a, b)] == [1, 3]
        writer.wait_for_more(500)
        drained = run("broker", "drain", "--broker", b.url)
        assert drained.returncode == 0 and "moved 3 partition(s)" in drained.stdout, drained
        assert [_owned(x.url) for x in (a, b)] == [4, 0]
        writer.wait_for_more(500)
    finally:
        acked = writer.stop()
    check_exactly_once_in_order(_read(a.url), acked)
    try:
        received.check(acked)
    except AssertionError:
        seen = {int(v.split(":")[1]) for v in list(received.values)}
        print("missing:", sorted(set(range(acked)) - seen)[:30], "of", acked)
        with Admin(a.url) as admin:
            print("subscriptions at A:", admin.subscriptions(TOPIC))
        for x in (a, b):
            print(f"--- {x.data_dir} said:\n" + "".join(x.stderr_tail))
        raise


def test_a_consumers_call_for_a_partition_drained_to_a_broker_is_served_there_at_once(
        network_store) -> None:
    """A unloads one of its 2 partitions to B, then B drains its 3 to A (leases of an hour:
    no renewal refreshes a view of who owns what). A consumer's call for each partition
    (a flow, as an ack), sent to A before any stream opened it there, is served by A."""
    _, _, broker = network_store
    a, b = (_cluster(broker, f"broker-{n}", "--lease-timeout", "1h").start() for n in "ab")
    _spread((a, b), 4)
    with Admin(a.url) as admin:
        mine = [p["partition"] for p in admin.topic_stats(TOPIC, per_partition=True)
                ["partitions"]]
    moved = run("topic", "unload", f"{TOPIC}/{mine[0]}", "--broker", a.url)
    assert moved.returncode == 0, moved.stderr
    drained = run("broker", "drain", "--broker", b.url)
    assert drained.returncode == 0 and "moved 3 partition(s)" in drained.stdout, drained
    with Admin(a.url) as admin:
        for p in range(4):
            with pytest.raises(NotFoundError, match="no subscription 'audit'"):
                admin.action("flow", {"topic": TOPIC, "subscription": "audit",
                                      "partition": p, "consumer": "c", "permits": 10})
    assert [_owned(x.url) for x in (a, b)] == [4, 0]


def test_a_cluster_broker_stopped_cleanly_hands_its_partitions_over_at_once(
        network_store) -> None:
    """A broker stopped cleanly seals its partitions and lets go of them: the other takes
    them over at its next renewal, not once a lease expired; a broker started after owns
    its share of the partitions nobody owns."""
    _, _, broker = network_store
    a = _cluster(broker, "broker-a", "--lease-timeout", "1h").start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 4)
    with Producer(TOPIC, broker=a.url) as producer:
        producer.send_many({"key": f"k{i % 7}", "value": f"k{i % 7}:{i}".encode()}
                           for i in range(200))
    b = _cluster(broker, "broker-b", "--lease-timeout", "1h").start()
    assert a.stop() == 0
    wait_for(lambda: _owned(b.url) == 4, timeout=scaled(30),
             what="broker B to take over the partitions broker A let go of")
    check_exactly_once_in_order(_read(b.url), 200)
    c = _cluster(broker, "broker-c", "--lease-timeout", "1h").start()
    assert _owned(c.url) == 0  # all owned by a live broker: nothing to take


def test_cluster_settings_that_cannot_work_are_one_line_each(network_store, tmp_path) -> None:
    """``--cluster`` without network bookies, with a lease shorter than two renewals, or
    beside a broker that serves the store alone, is refused saying why."""
    url, _, broker = network_store
    from tierstream.broker.config import StoreConfig

    with pytest.raises(ConfigError, match="--cluster needs --metadata"):
        StoreConfig.from_options({"dataDir": str(tmp_path / "x")}, metadata_url=url,
                                 lease_timeout_s=10.0)
    with pytest.raises(ConfigError, match="invalid --lease-timeout 1s"):
        StoreConfig.from_options({"dataDir": str(tmp_path / "x")}, metadata_url=url,
                                 network_bookies=True, lease_timeout_s=1.0)
    alone = broker("broker-alone").start()
    refused = run("broker", "drain", "--broker", alone.url or "")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: moving partitions is for brokers started with --cluster: this one serves the "
        "store alone"], refused.stderr
    refused = _cluster(broker, "broker-c")
    with pytest.raises(Exception, match="served by a broker started without --cluster"):
        refused.start(timeout=scaled(60))
    alone.stop()


def test_real_pulsar_clients_produce_and_consume_across_three_brokers_and_a_kill(
        network_store) -> None:
    """The real pulsar-client, given one broker's address, produces to a 6-partition topic
    placed over three cluster brokers (LOOKUP redirects it to each partition's owner) and a
    key_shared consumer receives; a broker is SIGKILLed and the client goes on with the
    partitions' new owners. Every acknowledged message is read back once, in key order."""
    import pulsar

    from ..pulsar_wire.helpers import client_of

    _, _, broker = network_store
    brokers = [_cluster(broker, f"broker-{n}", "--pulsar-port", str(fixed_port())).start()
               for n in "abc"]
    a, _, c = brokers
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 6)
    name = f"persistent://{TOPIC}"
    client = client_of(a)  # one broker's address: lookups find the rest
    received: list[str] = []
    try:
        consumer = client.subscribe(name, "audit", consumer_type=pulsar.ConsumerType.KeyShared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(name, batching_enabled=False,
                                          send_timeout_millis=int(scaled(60) * 1000))
        acked = 0
        for i in range(600):
            if i == 300:
                c.kill()  # mid-run: its partitions move to A and B
            producer.send(f"k{i % 7}:{i}".encode(), partition_key=f"k{i % 7}")
            acked = i + 1
        producer.close()
        while len(set(received)) < acked:
            msg = consumer.receive(timeout_millis=int(scaled(60) * 1000))
            received.append(msg.data().decode())
            consumer.acknowledge(msg)
        consumer.close()
    finally:
        client.close()
    assert _owned(a.url) + _owned(brokers[1].url) == 6
    check_exactly_once_in_order(_read(a.url), acked)
    check_exactly_once_in_order(list(dict.fromkeys(received)), acked)


def test_a_broker_started_without_cluster_is_refused_by_a_store_cluster_brokers_serve(
        network_store) -> None:
    """A broker started on a cluster's store without ``--cluster`` (or as a ``--standby``)
    claimed every partition of the store from the live cluster brokers at once: a flag
    forgotten on one host moved a whole store. It is refused in one line now, naming the
    brokers and the flag; the cluster broker keeps its partitions and serves on."""
    _, _, broker = network_store
    a = _cluster(broker, "broker-a").start()
    with Admin(a.url) as admin:
        admin.create_topic(TOPIC, 2)
    for name, extra in (("plain", ()), ("standby", ("--standby", "--takeover-after", "2s"))):
        refused = broker(f"broker-{name}", *extra)
        with pytest.raises(Exception, match="served by brokers started with --cluster") as e:
            refused.start(timeout=scaled(60))
        said = str(e.value)
        assert "Traceback" not in said, said
        assert "(broker-1), each owning some of its partitions: start this one with " \
            "--cluster too" in said, said
        assert ("a cluster's standby" in said) == (name == "standby"), said
        assert refused.proc is not None and refused.proc.wait(timeout=scaled(30)) != 0
    assert _owned(a.url) == 2
    with Producer(TOPIC, broker=a.url) as producer:
        producer.send_many({"key": f"k{i}", "value": f"k{i}:{i}".encode()} for i in range(7))
    check_exactly_once_in_order(_read(a.url), 7)


def _pulsar_call(broker: BrokerProcess, command: Any, kinds: tuple[int, ...]) -> Any:
    """One command on a new Pulsar connection to ``broker``, and its answer (of ``kinds``)."""
    from tierstream.pulsar_protocol import pulsar_api_pb2 as api
    from tierstream.pulsar_protocol.frames import command_frame

    from ..pulsar_wire.helpers import commands_until

    host, port = (broker.pulsar_url or "").removeprefix("pulsar://").rsplit(":", 1)
    hello = api.BaseCommand(type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
        client_version="t", protocol_version=20))
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(command_frame(hello) + command_frame(command))
        got = commands_until(sock, lambda cs: any(c.type in kinds for c in cs))
    return next(c for c in got if c.type in kinds)


def test_a_partition_unloaded_to_another_broker_is_sent_and_served_there_at_once(
        network_store) -> None:
    """Regression (a fresh clone's flake: a Pulsar subscribe timed out after an unload).
    Right after an unload, the former owner answered a lookup of the partition with itself
    (the new owner it noted had no Pulsar address), and the new owner, whose view of the
    owners was its last renewal's, refused the subscribe naming the former one: a client
    went back and forth until both had renewed, and under load did not get through. Now
    both brokers send the client to the new owner at once, and it serves the partition at
    the first call. Three moves, back and forth."""
    from tierstream.pulsar_protocol import pulsar_api_pb2 as api

    _, _, broker = network_store
    brokers = [_cluster(broker, f"broker-{n}", "--pulsar-port", str(fixed_port())).start()
               for n in "ab"]
    _spread(brokers, 2)
    ids = []
    for b in brokers:
        with Admin(b.url) as admin:
            ids.append(admin.stats()["broker"]["id"])
    name = f"persistent://{TOPIC}-partition-1"
    cmd = api.BaseCommand
    for move in range(3):
        with Admin(brokers[move % 2].url) as admin:  # followed to the owner where it is not
            to = admin.unload(TOPIC, 1)[f"{TOPIC}/1"]
        new, old = (brokers[0], brokers[1]) if to == ids[0] else (brokers[1], brokers[0])
        for asked in (old, new):
            answer = _pulsar_call(asked, cmd(type=cmd.LOOKUP, lookupTopic=api.CommandLookupTopic(
                topic=name, request_id=1)), (cmd.LOOKUP_RESPONSE,)).lookupTopicResponse
            assert answer.brokerServiceUrl == new.pulsar_url, \
                f"move {move}: {asked.pulsar_url} sends partition 1's clients to " \
                f"{answer.brokerServiceUrl}, not to its new owner {new.pulsar_url}"
        subscribed = _pulsar_call(new, cmd(type=cmd.SUBSCRIBE, subscribe=api.CommandSubscribe(
            topic=name, subscription=f"s{move}", subType=api.CommandSubscribe.Shared,
            consumer_id=1, request_id=2)), (cmd.SUCCESS, cmd.ERROR))
        assert subscribed.type == cmd.SUCCESS, \
            f"move {move}: the new owner refused: {subscribed.error.message}"


def test_compact_asked_of_one_cluster_broker_compacts_every_partition_by_its_owner(
        network_store) -> None:
    _, _, broker = network_store
    a = _cluster(broker, "broker-a", "--lease-timeout", "1h").start()
    b = _cluster(broker, "broker-b", "--lease-timeout", "1h").start()
    _spread([a, b], 4)
    with Producer(TOPIC, broker=a.url) as producer:
        producer.send_many({"key": f"k{i % 60}", "value": f"v{i}".encode()} for i in range(600))
    with Admin(a.url) as admin:
        done = admin.compact(TOPIC)
    assert done["status"] == "SUCCESS", done
    assert sorted(int(p) for p in done["run"]) == [0, 1, 2, 3]  # two by A, two by B
    assert sorted(s["partition"] for s in done["snapshots"]) == [0, 1, 2, 3]
    with Admin(b.url) as admin:
        status = admin.compaction(TOPIC)
    assert status["status"] == "SUCCESS" and sorted(int(p) for p in status["run"]) == [0, 1, 2, 3]
    rows = tierstream.read(TOPIC, broker=b.url, compacted=True).to_pylist()
    latest = {}
    for r in tierstream.read(TOPIC, broker=b.url).to_pylist():
        key = (r["partition"], r["key"])
        if key not in latest or (r["segment_id"], r["entry_id"], r["batch_index"]) > latest[key]:
            latest[key] = (r["segment_id"], r["entry_id"], r["batch_index"])
    assert {(r["partition"], r["key"]): (r["segment_id"], r["entry_id"], r["batch_index"])
            for r in rows} == latest
