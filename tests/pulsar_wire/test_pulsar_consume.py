"""Pulsar's wire protocol, part 2: real pulsar-client consumers on the broker's own
subscriptions — every type, acks to a backlog of zero, negative acks, a subscription shared
with tierstream's Consumer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections import defaultdict
from typing import Any

import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol import key_router
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, commands_until, each_message, rows_of

TYPES = {"exclusive": pulsar.ConsumerType.Exclusive, "failover": pulsar.ConsumerType.Failover,
         "shared": pulsar.ConsumerType.Shared, "key_shared": pulsar.ConsumerType.KeyShared}


def _backlog(broker: BrokerProcess, topic: str, subscription: str) -> int:
    with Admin(broker.url) as admin:
        rows = [r for r in admin.subscriptions(topic) if r["subscription"] == subscription]
    return sum(int(r["backlog"]) for r in rows)


def _drain(consumer: Any, until: Any, got: list[Any]) -> None:
    """Receive and acknowledge until ``until()`` holds (or the deadline passes)."""
    while not until():
        try:
            msg = consumer.receive(timeout_millis=int(scaled(0.5) * 1000))
        except pulsar.Timeout:
            continue
        got.append(msg)
        consumer.acknowledge(msg)


def test_an_exclusive_consumer_reads_what_tierstream_wrote_and_acks_it_to_zero(
        pulsar_broker: BrokerProcess) -> None:
    topic = "acme/web/consumed"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 2)
    with Producer(topic, broker=pulsar_broker.url) as producer:
        producer.send_many({"key": f"k{i % 7}", "value": f"v{i}".encode(),
                            "properties": {"i": str(i)}, "event_time": 1000 + i}
                           for i in range(300))
    client = client_of(pulsar_broker)
    got: list[Any] = []
    try:
        consumer = client.subscribe(f"persistent://{topic}", "audit",
                                    consumer_type=pulsar.ConsumerType.Exclusive,
                                    initial_position=pulsar.InitialPosition.Earliest)
        deadline = threading.Event()
        threading.Timer(scaled(60), deadline.set).start()
        _drain(consumer, lambda: len(got) >= 300 or deadline.is_set(), got)
        consumer.close()  # sends the acks the client still groups
    finally:
        client.close()
    assert sorted(m.data() for m in got) == sorted(f"v{i}".encode() for i in range(300))
    for m in got:
        i = int(m.properties()["i"])
        assert (m.partition_key(), m.event_timestamp()) == (f"k{i % 7}", 1000 + i)
        assert m.redelivery_count() == 0
    by_key: dict[str, list[int]] = defaultdict(list)
    for m in got:
        by_key[m.partition_key()].append(int(m.properties()["i"]))
    assert all(v == sorted(v) for v in by_key.values())  # each key in order
    wait_for(lambda: _backlog(pulsar_broker, topic, "audit") == 0, timeout=scaled(30),
             what="the backlog to reach 0")


@pytest.mark.parametrize("kind", ["shared", "key_shared"])
def test_three_consumers_on_batched_keyed_data_ack_everything_to_a_backlog_of_zero(
        pulsar_broker: BrokerProcess, kind: str) -> None:
    """The risk the design answers: a batch's messages go to different consumers; each is
    acknowledged on its own, nothing is delivered twice, the backlog reaches 0."""
    topic = f"acme/web/split-{kind}"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 2)
    client = client_of(pulsar_broker)
    total = 1200
    received: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    try:
        consumers = [client.subscribe(f"persistent://{topic}", "workers",
                                      consumer_type=TYPES[kind], consumer_name=f"w{n}",
                                      initial_position=pulsar.InitialPosition.Earliest)
                     for n in range(3)]
        producer = client.create_producer(f"persistent://{topic}", batching_enabled=True,
                                          batching_max_messages=50, message_router=key_router)
        for i in range(total):
            producer.send_async(f"{i}".encode(), None, partition_key=f"key-{i % 40}")
        producer.flush()
        stop = threading.Event()
        threading.Timer(scaled(90), stop.set).start()
        count = lambda: sum(len(v) for v in received.values())  # noqa: E731
        threads = [threading.Thread(target=_drain, args=(
            c, lambda: count() >= total or stop.is_set(), received[n]))
            for n, c in enumerate(consumers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in consumers:
            c.close()
    finally:
        client.close()
    values = [int(m.data()) for ms in received.values() for m in ms]
    assert sorted(values) == list(range(total))  # each once
    assert sum(1 for ms in received.values() if ms) >= 2  # the work was shared
    if kind == "key_shared":
        for ms in received.values():
            seen: dict[str, list[int]] = defaultdict(list)
            for m in ms:
                seen[m.partition_key()].append(int(m.data()))
            assert all(v == sorted(v) for v in seen.values())
    wait_for(lambda: _backlog(pulsar_broker, topic, "workers") == 0, timeout=scaled(30),
             what="the backlog to reach 0")


def test_a_negative_ack_is_delivered_again_and_a_tierstream_consumer_shares_the_subscription(
        pulsar_broker: BrokerProcess) -> None:
    topic = "public/default/nacked"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 1)
    client = client_of(pulsar_broker)
    try:
        consumer = client.subscribe(topic, "jobs", consumer_type=pulsar.ConsumerType.Shared,
                                    negative_ack_redelivery_delay_ms=100)
        with Producer(topic, broker=pulsar_broker.url) as producer:
            producer.send(b"poison")
        first = consumer.receive(timeout_millis=int(scaled(15) * 1000))
        assert (first.data(), first.redelivery_count()) == (b"poison", 0)
        consumer.negative_acknowledge(first)
        again = consumer.receive(timeout_millis=int(scaled(15) * 1000))
        assert (again.data(), again.redelivery_count()) == (b"poison", 1)
        consumer.acknowledge(again)
        with Consumer(topic, "jobs", mode="shared", broker=pulsar_broker.url,
                      initial=Offset.earliest()) as ours:
            with Producer(topic, broker=pulsar_broker.url, batch_size=10) as producer:
                producer.send_many({"value": f"m{i}".encode()} for i in range(200))
            seen: list[bytes] = []
            done = threading.Event()

            def pulsar_side() -> None:
                while not done.is_set():
                    try:
                        m = consumer.receive(timeout_millis=200)
                    except pulsar.Timeout:
                        continue
                    seen.append(m.data())
                    consumer.acknowledge(m)

            t = threading.Thread(target=pulsar_side, daemon=True)
            t.start()
            ours_seen: list[bytes] = []
            try:
                wait_for(lambda: _take(ours, ours_seen) or len(seen) + len(ours_seen) >= 200,
                         timeout=scaled(60), what="both consumers to share 200 messages")
            finally:
                done.set()
                t.join()
        consumer.close()
    finally:
        client.close()
    assert sorted(seen + ours_seen) == sorted(f"m{i}".encode() for i in range(200))
    assert seen and ours_seen  # both took a share


def _exists(broker: BrokerProcess, topic: str) -> bool:
    with Admin(broker.url) as admin:
        return topic in {t.name for t in admin.list_topics(topic.rsplit("/", 1)[0])}


def _take(consumer: Consumer, into: list[bytes]) -> bool:
    batch = consumer.receive(timeout=0.1)
    if batch is not None and batch.num_rows:
        into.extend(batch.column("value").to_pylist())
        consumer.ack(batch)
    return False


def test_readers_start_where_they_are_told_and_know_when_nothing_is_left(
        pulsar_broker: BrokerProcess) -> None:
    topic = "public/default/read"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 1)
    client = client_of(pulsar_broker)
    timeout = int(scaled(15) * 1000)
    try:
        empty = client.create_reader(topic, pulsar.MessageId.earliest)
        assert not empty.has_message_available()  # an empty topic
        at_end = client.create_reader(topic, pulsar.MessageId.latest)
        with Producer(topic, broker=pulsar_broker.url, batch_size=7) as producer:
            producer.send_many({"value": f"m{i}".encode()} for i in range(30))
        reader = client.create_reader(topic, pulsar.MessageId.earliest)
        got = []
        while reader.has_message_available():
            got.append(reader.read_next(timeout))
        assert [m.data() for m in got] == [f"m{i}".encode() for i in range(30)]
        assert [m.data() for m in (empty.read_next(timeout), empty.read_next(timeout))] == [
            b"m0", b"m1"]
        assert at_end.has_message_available()  # written after it started at the end
        assert at_end.read_next(timeout).data() == b"m0"
        middle = got[9].message_id()  # m9: a reader from it starts after it, or at it
        after = client.create_reader(topic, middle)
        assert after.read_next(timeout).data() == b"m10"
        at = client.create_reader(topic, middle, start_message_id_inclusive=True)
        assert at.read_next(timeout).data() == b"m9"
        with Admin(pulsar_broker.url) as admin:
            readers = {r["subscription"] for r in admin.subscriptions(topic)}
        assert len(readers) == 5
        for r in (empty, at_end, reader, after, at):
            r.close()
    finally:
        client.close()
    with Admin(pulsar_broker.url) as admin:  # a reader's cursor lives as long as the reader
        wait_for(lambda: admin.subscriptions(topic) == [], timeout=scaled(15),
                 what="the readers' cursors to go")


def test_a_readers_cursor_does_not_outlive_a_broker_killed_while_it_was_open(
        start_broker, free_port) -> None:
    """A reader's subscription is non-durable: deleted when the reader closes and, if the
    broker died first, when it starts again; a durable one beside it is kept. (The reader
    and the consumer are in a process killed with the broker, so that no client subscribes
    again after the restart.)"""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    topic = "public/default/read-crash"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    script = (
        "import pulsar, sys\n"
        f"c = pulsar.Client({broker.pulsar_url!r}, logger=pulsar.ConsoleLogger("
        "pulsar.LoggerLevel.Error))\n"
        f"r = c.create_reader({topic!r}, pulsar.MessageId.earliest)\n"
        f"k = c.subscribe({topic!r}, 'kept')\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with Admin(broker.url) as admin:
            assert len(admin.subscriptions(topic)) == 2
        broker.kill()
    finally:
        holder.kill()
        holder.wait()
    broker = start_broker("--pulsar-port", str(free_port))
    with Admin(broker.url) as admin:
        assert [r["subscription"] for r in admin.subscriptions(topic)] == ["kept"]


def test_acks_survive_a_broker_sigkill_and_a_poison_message_lands_in_the_dead_letter_topic(
        start_broker, free_port) -> None:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    topic = "public/default/durable"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    with Producer(topic, broker=broker.url, batch_size=25) as producer:
        producer.send_many({"value": f"m{i}".encode()} for i in range(100))
    client = client_of(broker)
    try:
        # batch-index acks: 60 of 100 in batches of 25 leave one batch acknowledged in part (a
        # client without them acknowledges a batch once every message of it is, as Pulsar's)
        consumer = client.subscribe(topic, "kept", initial_position=pulsar.InitialPosition.Earliest,
                                    batch_index_ack_enabled=True)
        for _ in range(60):
            consumer.acknowledge(consumer.receive(timeout_millis=int(scaled(15) * 1000)))
        consumer.close()  # its acks are answered before its close is
    finally:
        client.close()
    broker.kill()
    broker = start_broker("--pulsar-port", str(free_port))
    client = client_of(broker)
    try:
        again = client.subscribe(topic, "kept")
        rest = [again.receive(timeout_millis=int(scaled(15) * 1000)).data() for _ in range(40)]
        assert rest == [f"m{i}".encode() for i in range(60, 100)]
        with pytest.raises(pulsar.Timeout):  # and nothing acknowledged comes back
            again.receive(timeout_millis=int(scaled(1) * 1000))
        policy = pulsar.ConsumerDeadLetterPolicy(max_redeliver_count=2,
                                                 dead_letter_topic="public/default/poison-dlq")
        jobs = client.subscribe(topic, "jobs", consumer_type=pulsar.ConsumerType.Shared,
                                negative_ack_redelivery_delay_ms=100,
                                dead_letter_policy=policy)
        with Producer(topic, broker=broker.url) as producer:
            producer.send(b"poison")
        for count in range(3):  # delivered, then redelivered twice: each time nacked
            msg = jobs.receive(timeout_millis=int(scaled(15) * 1000))
            assert (msg.data(), msg.redelivery_count()) == (b"poison", count)
            jobs.negative_acknowledge(msg)
        # past max_redeliver_count the client sends it to the dead-letter topic instead
        wait_for(lambda: _exists(broker, "public/default/poison-dlq") and rows_of(
            broker, "public/default/poison-dlq"), timeout=scaled(30), what="the dead letter")
        with pytest.raises(pulsar.Timeout):
            jobs.receive(timeout_millis=int(scaled(1) * 1000))
    finally:
        client.close()
    dead = [r["value"] for r in rows_of(broker, "public/default/poison-dlq")]
    assert dead == [b"poison"]  # exactly once
    wait_for(lambda: _backlog(broker, topic, "jobs") == 0, timeout=scaled(30),
             what="the poison message to be acknowledged")


def test_failover_consumers_are_told_which_one_is_active(pulsar_broker: BrokerProcess) -> None:
    """ACTIVE_CONSUMER_CHANGE as the dispatcher's active consumer changes (the Python client
    has no listener for it, so the frames are read off the wire)."""
    cmd = api.BaseCommand
    host, port = pulsar_broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)

    def subscribe(consumer_id: int, name: str) -> bytes:
        return command_frame(cmd(type=cmd.SUBSCRIBE, subscribe=api.CommandSubscribe(
            topic="public/default/failing-over", subscription="standby", consumer_id=consumer_id,
            request_id=consumer_id, consumer_name=name, subType=api.CommandSubscribe.Failover)))

    def changes(got: list[Any]) -> dict[int, bool]:
        out: dict[int, bool] = {}
        for c in got:
            if c.type == cmd.ACTIVE_CONSUMER_CHANGE:
                out[c.active_consumer_change.consumer_id] = c.active_consumer_change.is_active
        return out

    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(command_frame(cmd(type=cmd.CONNECT, connect=api.CommandConnect(
            client_version="t", protocol_version=20))) + subscribe(1, "a") + subscribe(2, "b"))
        got = commands_until(sock, lambda cs: len(changes(cs)) == 2
                             and sorted(changes(cs).values()) == [False, True])
        first = changes(got)
        active = next(i for i, on in first.items() if on)
        standby = 3 - active
        sock.sendall(command_frame(cmd(type=cmd.CLOSE_CONSUMER, close_consumer=(
            api.CommandCloseConsumer(consumer_id=active, request_id=9)))))
        later = commands_until(sock, lambda cs: changes(cs).get(standby) is True)
    assert changes(later) == {standby: True}


def test_seek_by_message_id_and_by_publish_time_under_a_producer(
        pulsar_broker: BrokerProcess) -> None:
    """After a seek's success nothing from before the seek point arrives, though a producer
    goes on writing; by id the consumer resumes after the message (the client drops the
    message itself, as Pulsar's non-inclusive seek does), by time at the first message
    published at or after it."""
    topic = "public/default/seeking"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 1)
    with Producer(topic, broker=pulsar_broker.url, batch_size=10) as producer:
        producer.send_many({"value": f"m{i:04d}".encode()} for i in range(100))
    client = client_of(pulsar_broker)
    timeout = int(scaled(15) * 1000)
    stop = threading.Event()

    def keep_writing() -> None:
        with Producer(topic, broker=pulsar_broker.url) as producer:
            i = 100
            while not stop.is_set():
                producer.send(f"m{i:04d}".encode())
                i += 1

    writer = threading.Thread(target=keep_writing, daemon=True)
    try:
        consumer = client.subscribe(topic, "rewind",
                                    initial_position=pulsar.InitialPosition.Earliest)
        first = [consumer.receive(timeout) for _ in range(50)]
        for m in first:
            consumer.acknowledge(m)
        writer.start()
        consumer.seek(first[9].message_id())  # back, past acknowledged messages
        after = [consumer.receive(timeout).data() for _ in range(30)]
        assert after == [f"m{i:04d}".encode() for i in range(10, 40)], after[:5]
        consumer.seek(first[20].publish_timestamp())
        again = consumer.receive(timeout)
        assert again.publish_timestamp() >= first[20].publish_timestamp()
        assert again.data() <= b"m0020"  # at or before m20: several may share its time
        consumer.close()
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        client.close()


def test_key_shared_consumers_ride_out_a_broker_sigkill(start_broker, free_port) -> None:
    """Two Key_Shared consumers (each its own client) receive and acknowledge while the
    broker is SIGKILLed and restarted: their clients reconnect and subscribe again, every
    message arrives, each key's messages in order per consumer, and the backlog reaches 0.
    (Acks are asynchronous in the Python client, so a message received before the kill may
    come again; nothing is lost, and the acks the kill lost are sent again with them.)"""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    topic = "acme/web/crashing"
    total = 2000
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 2)
    with Producer(topic, broker=broker.url, batch_size=50) as producer:
        producer.send_many({"key": f"k{i % 30}", "value": f"{i}".encode()}
                           for i in range(total))
    clients = [client_of(broker) for _ in range(2)]
    received: dict[int, list[Any]] = {0: [], 1: []}
    stop = threading.Event()

    def consume(n: int) -> None:
        consumer = clients[n].subscribe(f"persistent://{topic}", "crash",
                                        consumer_type=pulsar.ConsumerType.KeyShared,
                                        consumer_name=f"c{n}",
                                        initial_position=pulsar.InitialPosition.Earliest)

        def keep(msg: Any) -> None:
            received[n].append(msg)
            consumer.acknowledge(msg)

        each_message(consumer, stop, keep, timeout_ms=200)
        consumer.close()

    threads = [threading.Thread(target=consume, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    distinct = lambda: len({int(m.data()) for ms in received.values() for m in ms})  # noqa: E731
    try:
        wait_for(lambda: distinct() >= total // 4, timeout=scaled(60), what="a quarter")
        broker.kill()
        broker = start_broker("--pulsar-port", str(free_port))
        wait_for(lambda: distinct() == total, timeout=scaled(120),
                 what="every message after the restart")
        # acks the kill lost come again with the messages, once the clients are back
        wait_for(lambda: _backlog(broker, topic, "crash") == 0, timeout=scaled(120),
                 what="the backlog to reach 0")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=scaled(30))
        for c in clients:
            c.close()
    for ms in received.values():
        firsts: dict[str, list[int]] = defaultdict(list)
        for m in ms:
            if m.redelivery_count() == 0 and int(m.data()) not in firsts[m.partition_key()]:
                firsts[m.partition_key()].append(int(m.data()))
        assert all(v == sorted(v) for v in firsts.values())
