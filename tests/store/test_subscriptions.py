"""Subscriptions as Pulsar's: four types, individual acks, redelivery, dead letters, through a
real broker process."""

from __future__ import annotations

import threading
from collections import defaultdict

import pyarrow as pa
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.errors import ConfigError, ConflictError
from tierstream.model.positions import KeyRange, Offset, Position

from .. import forkserver
from ..timing import scaled
from .helpers import read_all, wait_for

TOPIC = "acme/web/orders"


def _drain(consumer: Consumer, expected: float = float("inf"), timeout: float = 10.0,
           ack: bool = False) -> list[pa.RecordBatch]:
    """Batches until ``expected`` messages arrived, or none came for ``timeout`` seconds."""
    got, n = [], 0
    while n < expected:
        batch = consumer.receive(timeout=timeout)
        if batch is None:
            break
        if ack:
            consumer.ack(batch)
        got.append(batch)
        n += batch.num_rows
    return got


def _produce(url: str, n: int, partitions: int = 1, keys: int = 50, batch_size: int = 25
             ) -> None:
    with Admin(url) as admin:
        admin.create_topic(TOPIC, partitions, exist_ok=True)
    with Producer(TOPIC, broker=url, batch_size=batch_size) as producer:
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i % keys}"} for i in range(n))


def _backlog(url: str, subscription: str) -> int:
    with Admin(url) as admin:
        return sum(r["backlog"] for r in admin.subscriptions(TOPIC)
                   if r["subscription"] == subscription)


def _unacked(url: str, consumer: str) -> int:
    with Admin(url) as admin:
        return sum(c["unacked"] for r in admin.subscriptions(TOPIC) for c in r["consumers"]
                   if c["name"] == consumer)


def _receive_all(consumers: list[Consumer], total: int) -> dict[int, list[pa.RecordBatch]]:
    """Round-robin receive (acking each batch) until ``total`` messages came."""
    got: dict[int, list[pa.RecordBatch]] = defaultdict(list)
    n, idle = 0, 0
    while n < total and idle < len(consumers) * 50:
        for i, c in enumerate(consumers):
            batch = c.receive(timeout=scaled(0.05))
            if batch is None:
                idle += 1
                continue
            idle = 0
            c.ack(batch)
            got[i].append(batch)
            n += batch.num_rows
    return got


@pytest.mark.parametrize("mode", ["exclusive", "failover", "shared", "key_shared"])
def test_every_type_delivers_each_message_once_when_each_is_acked(broker: BrokerProcess,
                                                                  mode: str) -> None:
    url = broker.url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    count = 1 if mode == "exclusive" else 3
    consumers = [Consumer(TOPIC, "s", mode=mode, broker=url, initial=Offset.earliest(),
                          consumer_name=f"c{i}") for i in range(count)]
    try:
        _produce(url, 3_000, partitions=2)  # all consumers are there: no key moves
        got = _receive_all(consumers, 3_000)
        values = [v for batches in got.values() for b in batches
                  for v in b.column("value").to_pylist()]
        assert sorted(values) == sorted(f"v{i}".encode() for i in range(3_000))
        assert _backlog(url, "s") == 0
        owners: dict[str, set[int]] = defaultdict(set)
        for i, batches in got.items():
            for b in batches:
                for key in b.column("key").to_pylist():
                    owners[key].add(i)
        if mode == "key_shared":
            assert all(len(o) == 1 for o in owners.values()), "a key went to two consumers"
            assert len(got) == 3
        if mode == "shared":
            assert len(got) == 3, "shared spreads over every consumer with room"
        with Admin(url) as admin:
            assert {r["type"] for r in admin.subscriptions(TOPIC)} == {mode}
    finally:
        for c in consumers:
            c.close()


def test_an_ack_of_a_slice_acknowledges_just_its_rows_even_across_a_broker_kill(
        start_broker) -> None:
    broker = start_broker()
    _produce(broker.url, 30, batch_size=10)
    with Consumer(TOPIC, "audit", broker=broker.url, initial=Offset.earliest()) as c:
        batch = c.receive(timeout=scaled(10))
        assert batch is not None and batch.num_rows >= 5  # one entry, or several at once
        c.ack(batch.slice(2, 3))
        assert _backlog(broker.url, "audit") == 27
        with Admin(broker.url) as admin:
            row = admin.subscriptions(TOPIC)[0]
            assert row["acked_ranges"] == 1
            assert row["position"] == Position(0, batch.column("segment_id")[0].as_py(),
                                               batch.column("entry_id")[0].as_py(), 0)
    broker.kill()
    restarted = start_broker()
    with Consumer(TOPIC, "audit", broker=restarted.url) as c:
        rest = pa.Table.from_batches(_drain(c, 27, timeout=scaled(2)))
    assert rest.column("value").to_pylist() == [
        f"v{i}".encode() for i in range(30) if i not in (2, 3, 4)]
    assert set(rest.column("redelivery_count").to_pylist()) == {0}


def test_an_ack_naming_messages_twice_and_out_of_order_counts_each_once(broker) -> None:
    """The broker takes an ack's positions as they come: repeated, and out of log order, each
    message is acknowledged once and leaves its consumer's unacknowledged count once."""
    _produce(broker.url, 30, batch_size=10)
    with Consumer(TOPIC, "twice", broker=broker.url, initial=Offset.earliest()) as c:
        batch = c.receive(timeout=scaled(10))
        assert batch is not None and batch.num_rows >= 5
        c.ack(pa.concat_batches([batch.slice(3, 2), batch.slice(2, 3), batch.slice(0, 1),
                                 batch.slice(4, 1)]))
        assert _backlog(broker.url, "twice") == 26
        with Admin(broker.url) as admin:
            shown = admin.subscriptions(TOPIC)[0]["consumers"][0]
        assert shown["delivered"] - shown["unacked"] == 4  # (it may have been sent more)


def test_every_other_message_acknowledged_stays_acknowledged_across_a_broker_kill(
        start_broker) -> None:
    """Key_Shared consumers acknowledge interleaved messages: a hole every other message, kept
    as one bitmap per entry (not a range per message) and read back as ranges."""
    broker = start_broker()
    _produce(broker.url, 400, batch_size=100)
    with Consumer(TOPIC, "audit", broker=broker.url, initial=Offset.earliest()) as c:
        got = pa.Table.from_batches(_drain(c, 400, timeout=scaled(10)))
        assert got.num_rows == 400
        for batch in got.to_batches():
            c.ack(batch.filter(pa.array([i % 2 == 0 for i in range(batch.num_rows)])))
        assert _backlog(broker.url, "audit") == 200
    broker.kill()
    restarted = start_broker()
    with Admin(restarted.url) as admin:
        row = admin.subscriptions(TOPIC)[0]
    assert row["backlog"] == 200 and row["acked_ranges"] >= 199
    with Consumer(TOPIC, "audit", broker=restarted.url) as c:
        rest = pa.Table.from_batches(_drain(c, 200, timeout=scaled(2)))
    even = {v for b in got.to_batches()
            for i, v in enumerate(b.column("value").to_pylist()) if i % 2 == 0}
    assert sorted(rest.column("value").to_pylist()) == sorted(
        set(got.column("value").to_pylist()) - even)


def test_batches_of_a_lost_connection_are_dropped_as_soon_as_it_is_lost(
        start_broker, caplog: pytest.LogCaptureFixture) -> None:
    """What the broker sent before it died and receive() has not returned comes again, maybe
    to another consumer that acknowledges it before this one is back: receive() must not hand
    it out meanwhile (it did until the re-attach, which the chaos run caught)."""
    broker = start_broker()
    _produce(broker.url, 100, batch_size=10)
    c = Consumer(TOPIC, "audit", broker=broker.url, initial=Offset.earliest())
    try:
        wait_for(lambda: c.buffered >= 1, timeout=scaled(10), what="a batch queued")
        caplog.set_level("INFO", logger="tierstream.client.consumer")
        broker.kill()
        wait_for(lambda: "reconnecting" in caplog.text, timeout=scaled(10),
                 what="the consumer to notice the broker is gone")
        assert c.receive(timeout=scaled(0.2)) is None
    finally:
        c.close()


def test_cumulative_acks_on_exclusive_resume_after_the_acked_position(broker) -> None:
    _produce(broker.url, 100, batch_size=10)
    with Consumer(TOPIC, "billing", broker=broker.url, initial=Offset.earliest()) as c:
        first = pa.Table.from_batches(_drain(c, 100))
        c.ack_cumulative(Position(0, first.column("segment_id")[44].as_py(),
                                  first.column("entry_id")[44].as_py(),
                                  first.column("batch_index")[44].as_py()))
    with Consumer(TOPIC, "billing", broker=broker.url) as c:
        rest = pa.Table.from_batches(_drain(c, 55))
    assert rest.column("value").to_pylist() == [f"v{i}".encode() for i in range(45, 100)]


def test_bad_inputs_get_one_clear_line_each(broker) -> None:
    url = broker.url
    _produce(url, 20)
    with Consumer(TOPIC, "ks", mode="key_shared", key_ranges=[KeyRange(0, 1000)], broker=url,
                  initial=Offset.earliest()):
        with pytest.raises(ConflictError, match="overlap those of consumer"):
            Consumer(TOPIC, "ks", mode="key_shared", key_ranges=[KeyRange(500, 2000)],
                     broker=url)
        with pytest.raises(ConflictError, match="is key_shared; a shared consumer cannot "
                                                "join it"):
            Consumer(TOPIC, "ks", mode="shared", broker=url)
        with pytest.raises(ConflictError, match="a consumer without key_ranges"):
            Consumer(TOPIC, "ks", mode="key_shared", broker=url)
    with Consumer(TOPIC, "ex", broker=url), \
            pytest.raises(ConflictError, match="already has an exclusive consumer"):
        Consumer(TOPIC, "ex", broker=url)
    with Consumer(TOPIC, "sh", mode="shared", broker=url, initial=Offset.earliest()) as a, \
            Consumer(TOPIC, "other", mode="shared", broker=url,
                     initial=Offset.earliest()) as b:
        batch = a.receive(timeout=scaled(10))
        assert batch is not None
        with pytest.raises(ConfigError, match="not received by consumer"):
            b.ack(batch)
        with pytest.raises(ConfigError, match="ack_cumulative is for exclusive and failover"):
            a.ack_cumulative(batch)
        with pytest.raises(ConfigError, match="needs a batch this consumer received"):
            a.ack(batch.select(["value"]))
    for kwargs, message in [({"mode": "round_robin"}, "invalid mode 'round_robin'"),
                            ({"mode": "shared", "key_ranges": [KeyRange(0, 10)]},
                             "key_ranges are for mode='key_shared'"),
                            ({"receiver_queue_size": 0}, "invalid receiver_queue_size 0"),
                            ({"ack_timeout": "30"}, "a duration needs a unit"),
                            ({"dead_letter_topic": "a/b/c"}, "needs max_redeliveries")]:
        with pytest.raises(ConfigError, match=message):
            Consumer(TOPIC, "bad", broker=url, **kwargs)  # type: ignore[arg-type]


def test_a_key_that_moves_waits_for_the_old_owner_s_acks(broker) -> None:
    url = broker.url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=url, batch_size=20) as producer:  # 40 keys in runs of 10
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i // 10 % 40}"}
                           for i in range(2_000))
    first = Consumer(TOPIC, "ordered", mode="key_shared", broker=url, consumer_name="first",
                     initial=Offset.earliest(), receiver_queue_size=200)
    # it takes its 200 permits' worth (keys k0..k19) and receives none of it yet
    wait_for(lambda: _unacked(url, "first") == 200, timeout=scaled(10),
             what="the first consumer's receiver queue to fill")
    held_keys = {f"k{i}" for i in range(20)}
    second = Consumer(TOPIC, "ordered", mode="key_shared", broker=url, consumer_name="second")
    try:
        early = _drain(second, timeout=scaled(1.0))
        early_keys = {k for b in early for k in b.column("key").to_pylist()}
        assert early_keys, "the keys that did not move keep flowing"
        assert not early_keys & held_keys, "a moved key reached its new owner before the " \
                                           "old owner acknowledged it"
        for b in _drain(first, 200, timeout=scaled(2)):
            first.ack(b)
        moved = _drain(second, timeout=scaled(1.0), ack=True)
        assert {k for b in moved for k in b.column("key").to_pylist()} & held_keys
        for b in early:
            second.ack(b)
        _receive_all([first, second], 2_000)
        assert _backlog(url, "ordered") == 0
    finally:
        first.close()
        second.close()


def test_what_a_closed_consumer_held_goes_to_the_others_with_its_count(broker) -> None:
    url = broker.url
    _produce(url, 500, batch_size=50)
    a = Consumer(TOPIC, "work", mode="shared", broker=url, consumer_name="a",
                 initial=Offset.earliest(), receiver_queue_size=100)
    batch = a.receive(timeout=scaled(10))
    assert batch is not None
    taken = set(batch.column("value").to_pylist())
    with Consumer(TOPIC, "work", mode="shared", broker=url, consumer_name="b") as b:
        a.close()
        got = pa.Table.from_batches(_drain(b, 500, timeout=scaled(2), ack=True))
    assert sorted(got.column("value").to_pylist()) == sorted(f"v{i}".encode()
                                                             for i in range(500))
    again = {v: n for v, n in zip(got.column("value").to_pylist(),
                                  got.column("redelivery_count").to_pylist(), strict=True)
             if v in taken}
    assert set(again.values()) == {1}


def test_a_key_shared_consumer_attaching_after_acks_emptied_listed_entries_is_served(
        broker) -> None:
    """Regression: acks that came while no consumer was attached emptied entries still listed
    as waiting; the next key_shared consumer's attach grouped one of them, already let go, and
    failed after the dispatcher had taken the consumer. Its client, told to try again, met
    itself ("already has a consumer named ... connected") and gave up: after a broker restart,
    a consumer whose acks of what it held came before its re-attach died so."""
    from tierstream.client.connection import BrokerClient
    from tierstream.wire.flight import encode_positions

    url = broker.url
    _produce(url, 100, batch_size=20)
    a = Consumer(TOPIC, "work", mode="key_shared", broker=url, consumer_name="a",
                 initial=Offset.earliest())
    held = _drain(a, 100, timeout=scaled(2))
    a.close()  # what it held waits again, and nobody is attached
    with BrokerClient(url) as client:
        for batch in held:  # its acks come after its close, as a restarted broker may see them
            client.action("ack", {"topic": TOPIC, "subscription": "work", "partition": 0,
                                  "consumer": "a", **encode_positions(batch)})
    _produce(url, 10, batch_size=20)  # (values v0..v9 again: the new ones)
    with Consumer(TOPIC, "work", mode="key_shared", broker=url, consumer_name="b") as b:
        got = _drain(b, 10, timeout=scaled(2), ack=True)
    assert sum(batch.num_rows for batch in got) == 10
    assert _backlog(url, "work") == 0


def test_a_closed_consumer_is_gone_from_the_broker_when_close_returns(broker) -> None:
    """Pulsar's CloseConsumer: close() detaches before it returns, so the next exclusive
    consumer never finds the last one still there (a close used to take effect when the
    broker noticed the cancelled stream, which a busy machine delayed past the join's grace)."""
    url = broker.url
    _produce(url, 20, partitions=2)
    with Admin(url) as admin:
        for i in range(5):
            Consumer(TOPIC, "solo", broker=url, initial=Offset.earliest(),
                     consumer_name=f"c{i}").close()
            attached = [c["name"] for r in admin.subscriptions(TOPIC) for c in r["consumers"]]
            assert attached == [], f"after close() #{i}: {attached}"


def test_nacked_messages_come_back_then_go_to_the_dead_letter_topic_once(broker) -> None:
    url = broker.url
    _produce(url, 3, batch_size=3)
    with Consumer(TOPIC, "fragile", mode="shared", broker=url, initial=Offset.earliest(),
                  nack_delay=0.05, max_redeliveries=2) as c:
        counts = []
        for _ in range(3):
            batch = c.receive(timeout=scaled(10))
            assert batch is not None and batch.num_rows == 3
            counts.append(batch.column("redelivery_count").to_pylist())
            c.nack(batch)
        assert counts == [[0] * 3, [1] * 3, [2] * 3]
        dlq = f"{TOPIC}-fragile-DLQ"
        with Admin(url) as admin:
            wait_for(lambda: _backlog(url, "fragile") == 0, timeout=scaled(10),
                     what="the originals to be acknowledged")
            assert admin.get_topic(dlq).partitions == 1
        assert c.receive(timeout=scaled(0.3)) is None
    dead = read_all(url, dlq)
    assert sorted(dead.column("value").to_pylist()) == [b"v0", b"v1", b"v2"]
    props = dict(dead.column("properties")[0].as_py())
    assert props["REAL_TOPIC"] == f"{TOPIC}-partition-0"
    assert props["ORIGIN_MESSAGE_ID"].startswith("0:")
    assert props["tierstream.dead_letter.subscription"] == "fragile"


def test_an_unacknowledged_message_comes_back_after_the_ack_timeout(broker) -> None:
    _produce(broker.url, 5, batch_size=5)
    with Consumer(TOPIC, "slow", broker=broker.url, initial=Offset.earliest(),
                  ack_timeout=0.2) as c:
        first = c.receive(timeout=scaled(10))
        again = c.receive(timeout=scaled(10))
        assert first is not None and again is not None
        assert again.column("value").to_pylist() == first.column("value").to_pylist()
        assert again.column("redelivery_count").to_pylist() == [1] * 5
        c.ack(again)
        assert c.receive(timeout=scaled(0.5)) is None


def test_failover_spreads_partitions_and_the_standby_takes_over(broker) -> None:
    url = broker.url
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    a = Consumer(TOPIC, "fo", mode="failover", broker=url, consumer_name="a",
                 initial=Offset.earliest())
    b = Consumer(TOPIC, "fo", mode="failover", broker=url, consumer_name="b")
    try:
        _produce(url, 400, partitions=2, batch_size=20)
        got = _receive_all([a, b], 400)
        parts = {i: {p for x in batches for p in x.column("partition").to_pylist()}
                 for i, batches in got.items()}
        assert sorted(map(sorted, parts.values())) == [[0], [1]], parts
        with Producer(TOPIC, broker=url, batch_size=20) as producer:
            producer.send_many({"value": f"w{i}".encode(), "key": f"k{i}"} for i in range(100))
        a.close()
        rest = pa.Table.from_batches(_drain(b, 100, timeout=scaled(2), ack=True))
        assert sorted(rest.column("value").to_pylist()) == sorted(f"w{i}".encode()
                                                                  for i in range(100))
    finally:
        a.close()
        b.close()


def test_a_full_receiver_queue_holds_up_only_its_consumer(broker) -> None:
    url = broker.url
    _produce(url, 1_000, batch_size=10)
    stalled = Consumer(TOPIC, "q", mode="shared", broker=url, consumer_name="stalled",
                       initial=Offset.earliest(), receiver_queue_size=20)
    try:
        with Consumer(TOPIC, "q", mode="shared", broker=url, consumer_name="busy") as busy:
            got = pa.Table.from_batches(_drain(busy, 980, timeout=scaled(2), ack=True))
            assert got.num_rows == 980
            with Admin(url) as admin:
                row = admin.subscriptions(TOPIC)[0]
            mine = next(c for c in row["consumers"] if c["name"] == "stalled")
            assert mine["unacked"] == 20 and mine["permits"] == 0
    finally:
        stalled.close()


def test_acks_are_stored_in_grouped_transactions(broker) -> None:
    url = broker.url
    _produce(url, 4_000, partitions=4, batch_size=10)
    with Admin(url) as admin:
        before = admin.stats()["cursor_writes"]
    consumers = [Consumer(TOPIC, "many", mode="shared", broker=url, consumer_name=f"c{i}",
                          initial=Offset.earliest(), receiver_queue_size=100)
                 for i in range(8)]
    acks = [0]

    def work(c: Consumer) -> None:
        while (batch := c.receive(timeout=scaled(1.0))) is not None:
            for i in range(batch.num_rows):
                c.ack(batch.slice(i, 1))
                acks[0] += 1

    threads = [threading.Thread(target=work, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in consumers:
        c.close()
    assert acks[0] == 4_000 and _backlog(url, "many") == 0
    with Admin(url) as admin:
        writes = admin.stats()["cursor_writes"] - before
    assert writes < acks[0] * 0.8, f"{writes} writes for {acks[0]} acks"


def test_subscriptions_show_type_backlog_and_consumers(broker: BrokerProcess) -> None:
    import json
    import sys

    url = broker.url
    _produce(url, 2_000, partitions=2, batch_size=50)
    with Admin(url) as admin:
        ends = {p: end for p, (_, end) in admin.last_confirmed(TOPIC).items()}
        counts = {p: admin.advance(TOPIC, Position(p, 0, 0, 0), 10**9, ends[p])[1]
                  for p in ends}
        middle, _ = admin.advance(TOPIC, Position(1, 0, 0, 0), 700, ends[1])
        admin.set_cursor(TOPIC, "spark-job", {0: ends[0], 1: middle})
        with Consumer(TOPIC, "live", mode="key_shared", broker=url,
                      initial=Offset.earliest(), consumer_name="reader-a",
                      receiver_queue_size=100) as consumer:
            wait_for(lambda: consumer.buffered > 0, timeout=scaled(10), what="deliveries")
            rows = {(r["subscription"], r["partition"]): r for r in admin.subscriptions(TOPIC)}
            assert rows[("spark-job", 0)]["backlog"] == 0
            assert rows[("spark-job", 1)]["backlog"] == counts[1] - 700
            assert rows[("spark-job", 1)]["type"] is None
            assert rows[("live", 0)]["backlog"] == counts[0]  # nothing acknowledged
            assert rows[("live", 0)]["type"] == "key_shared"
            shown = rows[("live", 0)]["consumers"]
            assert [c["name"] for c in shown] == ["reader-a"]
            assert shown[0]["assignment"] == "0:65536" and shown[0]["unacked"] == 50
            proc = forkserver.run([sys.executable, "-m", "tierstream", "subscriptions", TOPIC,
                                   "--broker", url, "--json"], capture_output=True, text=True,
                                  timeout=scaled(60))
            assert proc.returncode == 0, proc.stderr
            listed = {(r["subscription"], r["partition"]): r for r in json.loads(proc.stdout)}
            assert listed[("spark-job", 1)]["backlog"] == counts[1] - 700
            table = forkserver.run([sys.executable, "-m", "tierstream", "subscriptions", TOPIC,
                                    "--broker", url], capture_output=True, text=True,
                                   timeout=scaled(60))
            assert table.returncode == 0, table.stderr
            assert "reader-a" in table.stdout and "key_shared" in table.stdout


def test_an_abandoned_subscription_can_be_deleted_but_not_while_attached(
        broker: BrokerProcess) -> None:
    import sys

    from tierstream.errors import NotFoundError

    url = broker.url
    _produce(url, 20, partitions=2)
    with Admin(url) as admin:
        consumer = Consumer(TOPIC, "old-job", broker=url, initial=Offset.earliest(),
                            consumer_name="still-here")
        try:
            with pytest.raises(ConflictError, match="consumers attached \\(still-here\\)"):
                admin.delete_subscription(TOPIC, "old-job")
        finally:
            consumer.close()
        wait_for(lambda: not any(r["consumers"] for r in admin.subscriptions(TOPIC)),
                 timeout=scaled(10), what="the broker to see the consumer leave")
        proc = forkserver.run([sys.executable, "-m", "tierstream", "subscriptions", TOPIC,
                               "--delete", "old-job", "--broker", url], capture_output=True,
                              text=True, timeout=scaled(60))
        assert proc.returncode == 0, proc.stderr
        assert "deleted subscription 'old-job'" in proc.stdout
        assert admin.subscriptions(TOPIC) == []
        with pytest.raises(NotFoundError, match="no subscription 'old-job'"):
            admin.delete_subscription(TOPIC, "old-job")
        # a consumer of that name starts afresh at its initial position
        with Consumer(TOPIC, "old-job", broker=url, initial=Offset.latest()) as again:
            assert again.receive(timeout=scaled(0.5)) is None


def test_the_cli_consumes_through_a_subscription_and_acknowledges_what_it_printed(
        broker: BrokerProcess) -> None:
    import json
    import subprocess
    import sys

    url = broker.url
    _produce(url, 300, partitions=2)

    def consume(*args: str) -> subprocess.CompletedProcess[str]:
        return forkserver.run([sys.executable, "-m", "tierstream", "consume", TOPIC,
                               "--broker", url, "--idle", f"{scaled(2)}s", *args],
                              capture_output=True, text=True, timeout=scaled(120))

    first = consume("-s", "cli", "--type", "key_shared", "--limit", "100")
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(rows) == 100 and {r["redelivery_count"] for r in rows} == {0}
    rest = consume("-s", "cli", "--type", "key_shared")
    assert rest.returncode == 0, rest.stderr
    rows += [json.loads(line) for line in rest.stdout.splitlines()]
    assert sorted(r["value"] for r in rows) == sorted(f"v{i}" for i in range(300))
    assert _backlog(url, "cli") == 0
    for args, needle in [
            (["-s", "cli", "--type", "shared"],
             "subscription 'cli' on 'acme/web/orders' is key_shared; a shared consumer "
             "cannot join it"),
            (["-s", "x", "--type", "fanout"], "invalid --type 'fanout'"),
            (["-s", "x", "--type", "shared", "--key-range", "0:100"],
             "--key-range is for --type key_shared, not shared"),
            (["-s", "x", "--to", "latest"], "--to reads the log directly"),
            (["--type", "shared"], "--type and --consumer-name are for a subscription")]:
        proc = consume(*args)
        assert proc.returncode != 0 and needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", ["key_shared", "shared"])
def test_copies_dropped_after_a_reattach_give_their_permits_back(start_broker, free_port,
                                                                 mode: str) -> None:
    """An ack that crosses a broker restart puts its messages in doubt; the re-attached
    stream sends them again and the consumer drops the copies. Those copies used permits of
    the new stream: if the consumer does not count them, it never asks for more and its
    share of the subscription stops for good (found by the subscription chaos run, a
    key_shared consumer at 0 permits and 0 unacked, a backlog of 19,912 behind it)."""
    broker: BrokerProcess = start_broker(port=free_port)
    topic = "acme/web/permits"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    with Producer(topic, broker=broker.url, batch_size=6) as producer:
        producer.send_many({"key": "k", "value": f"v{i}".encode()} for i in range(60))
    with Consumer(topic, "billing", mode=mode, broker=broker.url, receiver_queue_size=10,
                  initial=Offset.earliest()) as consumer:
        first = consumer.receive(timeout=scaled(30))
        assert first is not None  # as many messages as it has permits (10)
        broker.kill()
        broker = start_broker(port=free_port)
        # the re-attached stream sends what was not acknowledged, the first batch again,
        # before the ack (the queue may also hold batches of the lost stream: the restarted
        # broker's count says the copies went out)
        with Admin(broker.url) as admin:
            wait_for(lambda: sum(c["unacked"] for row in admin.subscriptions(topic)
                                 for c in row["consumers"]) > 0,
                     what="the stream to re-attach and send the first batch again")
        consumer.ack(first)  # from the lost stream: its copies are in doubt and dropped
        seen = [v.decode() for v in first.column("value").to_pylist()]
        while len(seen) < 60:
            batch = consumer.receive(timeout=scaled(10))
            assert batch is not None, f"stalled after {len(seen)} of 60 messages"
            seen += [v.decode() for v in batch.column("value").to_pylist()]
            consumer.ack(batch)
    assert seen == [f"v{i}" for i in range(60)]


def test_a_subscription_whose_data_was_unreadable_for_a_while_reads_on(start_broker) -> None:
    """Regression: one failed read (an entry unreadable on every replica: a bookie's ledger
    away, its host down) ended the subscription's reader for good, and its consumers got
    nothing more until the broker restarted. Now the read is tried again until it reads."""
    first = start_broker("--max-entries-per-segment", "4")
    with Admin(first.url) as admin:
        admin.create_topic(TOPIC, 1)
    _produce(first.url, 100, batch_size=10)
    assert first.stop() == 0
    broker = start_broker()  # its caches empty: every read goes to the bookie
    ledger = broker.data_dir / "bookies" / "bookie-0" / "ledgers" / "000000" / "1.log"
    away = ledger.with_name("1.log.away")
    ledger.rename(away)
    got: list[bytes] = []
    with Consumer(TOPIC, "patient", broker=broker.url, initial=Offset.earliest()) as c:
        wait_for(lambda: "ledger 1 is missing" in "".join(broker.stderr_tail), timeout=scaled(30),
                 what="the subscription's read to fail")
        assert c.receive(timeout=scaled(0.5)) is None
        away.rename(ledger)  # the bookie's data is back
        while len(got) < 100:
            batch = c.receive(timeout=scaled(15))
            assert batch is not None, f"the subscription stalled after {len(got)} messages"
            got.extend(batch.column("value").to_pylist())
            c.ack(batch)
    assert got == [f"v{i}".encode() for i in range(100)]
    assert "reads again after" in "".join(broker.stderr_tail)


def test_a_grouped_chunk_hands_out_exactly_the_rows_asked_for() -> None:
    """A key_shared chunk keeps its rows also grouped by consumer, so that each consumer's
    next messages are a slice of it, not a gather: whatever rows are asked for (one
    consumer's run, a run cut short, rows of several consumers, rows returned for
    redelivery), the batch handed out holds exactly those rows, in log order."""
    import random

    import numpy as np

    from tierstream.broker.subscriptions.read_window import Chunk
    from tierstream.model.message_format import CONSUMER_SCHEMA, MESSAGE_SCHEMA

    n = 200
    rng = random.Random(7)
    batch = pa.RecordBatch.from_pydict({
        "key": [f"k{i % 13}" for i in range(n)], "key_hash": [i % 13 for i in range(n)],
        "value": [f"v{i}".encode() for i in range(n)], "publish_time": list(range(n)),
        "event_time": [None] * n, "properties": [None] * n, "partition": [0] * n,
        "segment_id": [3] * n, "entry_id": [9] * n, "batch_index": list(range(n))},
        schema=MESSAGE_SCHEMA)
    chunk = Chunk(batch)
    owner = np.array([rng.randrange(4) for _ in range(13)])[chunk.slots]
    chunk.group(owner, by=1)
    asks = [chunk.rows_of(2)[:7], chunk.rows_of(2)[7:30], chunk.rows_of(0),
            np.arange(5, 60), np.array([1, 4, 150]),
            *(np.array(sorted(rng.sample(range(n), rng.randrange(1, n)))) for _ in range(50))]
    for rows in asks:
        out = chunk.take(rows)
        assert out.column("batch_index").to_pylist() == rows.tolist()
        assert out.column("value").to_pylist() == [f"v{i}".encode() for i in rows.tolist()]
    assert all(np.all(owner[chunk.rows_of(c)] == c) for c in range(4))
    # rows of two groups interleaved: their places in the grouped rows (0, 2, 1, 3) span a
    # run, out of order
    key = np.full(n, 2)
    key[[0, 4]], key[[2, 6]] = 0, 1
    chunk.group(key, by=2)
    assert chunk.take(np.array([0, 2, 4, 6])).column("batch_index").to_pylist() == [0, 2, 4, 6]
    chunk.handed_out()  # the grouped copy dropped: a redelivery's rows are gathered
    assert chunk.take(chunk.rows_of(1)).column("batch_index").to_pylist() == [2, 6]
    assert sorted(np.concatenate([chunk.rows_of(c) for c in range(4)]).tolist()) == \
        list(range(n))
    # once messages are sent again, every way of handing out rows carries their counts
    chunk.group(owner, by=3)
    chunk.count_redelivery(np.array([5, 6, 7]))
    chunk.count_redelivery(np.array([6]))
    for rows in (np.arange(4, 9), chunk.rows_of(2), np.array([1, 6, 150]), np.arange(n)):
        out = chunk.take(rows)
        assert out.schema.equals(CONSUMER_SCHEMA, check_metadata=True)
        assert out.column("batch_index").to_pylist() == rows.tolist()
        assert out.column("redelivery_count").to_pylist() == \
            [{5: 1, 6: 2, 7: 1}.get(i, 0) for i in rows.tolist()]


def test_a_client_that_lost_its_consumers_stream_attaches_again_in_its_place(
        broker: BrokerProcess) -> None:
    """A client that lost a consumer's stream without a word (its connection cut off: no
    reset reaches the broker) attaches again under the same name. The broker, which may not
    have noticed, takes the new attach from the same client object (``instance``) in the old
    one's place, what it held coming again; before, it refused "already has a consumer
    named", and the client took that as final and died. Another client's consumer of that
    name is still refused."""
    import pyarrow.flight as flight

    from tierstream.wire.flight import encode, translate_errors

    _produce(broker.url, 20)
    sub = {"name": "s", "type": "exclusive", "consumer": "c", "initial": {"kind": "earliest"},
           "instance": "c/one"}
    ticket = {"op": "consume", "topic": TOPIC, "partition": 0, "subscription": sub}
    clients = [flight.connect(broker.url) for _ in range(3)]
    try:
        lost = clients[0].do_get(flight.Ticket(encode(ticket)))
        assert lost.read_chunk().data.num_rows == 20  # held, never acknowledged
        with translate_errors(broker.url):
            again = clients[1].do_get(flight.Ticket(encode(ticket)))
            batch = again.read_chunk().data
        assert batch.num_rows == 20
        assert batch.column("redelivery_count").to_pylist() == [1] * 20
        other = {**ticket, "subscription": {**sub, "instance": "c/two"}}
        with pytest.raises(ConflictError, match="already has a consumer named 'c'"), \
                translate_errors(broker.url):
            clients[2].do_get(flight.Ticket(encode(other))).read_chunk()
        with pytest.raises(StopIteration):  # the stream taken over ended
            lost.read_chunk()
    finally:
        for client in clients:
            client.close()
