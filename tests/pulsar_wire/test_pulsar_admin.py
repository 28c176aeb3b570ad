"""Pulsar's admin REST subset (``--admin-port``), driven as curl scripts drive it, with the
real Pulsar client producing to and consuming from the topics it creates."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.pulsar_protocol import key_router

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, free_port


def _call(broker: BrokerProcess, method: str, path: str, body: Any = None,
          token: str | None = None) -> tuple[int, Any]:
    """(HTTP status, decoded JSON answer or None) of one admin call."""
    data = None if body is None else (body if isinstance(body, bytes)
                                      else json.dumps(body).encode())
    request = urllib.request.Request(f"{broker.admin_url}/admin/v2/{path}", data=data,
                                     method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=scaled(30)) as answer:
            raw = answer.read()
            return answer.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


@pytest.fixture
def admin_broker(start_broker) -> BrokerProcess:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port()),
                                         "--admin-port", str(free_port()))
    assert broker.admin_url and broker.admin_url.startswith("http://127.0.0.1:")
    return broker


def test_a_partitioned_topic_made_over_rest_is_produced_consumed_and_described(
        admin_broker) -> None:
    b = admin_broker
    topic = "persistent/public/default/clicks"
    assert _call(b, "PUT", f"{topic}/partitions", 3) == (204, None)
    assert _call(b, "GET", f"{topic}/partitions") == (200, {"partitions": 3})
    status, answer = _call(b, "PUT", f"{topic}/partitions", 3)
    assert status == 409 and "already exists" in answer["reason"]
    for bad in (0, "three", b"not json", -2):
        status, answer = _call(b, "PUT", "persistent/public/default/other/partitions", bad)
        assert status == 406 and "invalid partition count" in answer["reason"], answer
    assert _call(b, "GET", "persistent/public/default/other/partitions")[0] == 404
    assert _call(b, "PUT", "persistent/public/default/single") == (204, None)
    assert _call(b, "GET", "persistent/public/default/single/partitions") == (
        200, {"partitions": 0})  # non-partitioned, as the binary protocol says
    assert _call(b, "GET", "persistent/public/default") == (200, [
        *(f"persistent://public/default/clicks-partition-{i}" for i in range(3)),
        "persistent://public/default/single"])
    assert _call(b, "GET", "persistent/public/default/partitioned") == (
        200, ["persistent://public/default/clicks"])

    client = client_of(b)
    try:
        producer = client.create_producer("persistent://public/default/clicks",
                                          batching_enabled=True, message_router=key_router)
        for i in range(300):
            producer.send_async(f"m{i}".encode(), None, partition_key=f"k{i % 20}")
        producer.flush()
        consumer = client.subscribe("persistent://public/default/clicks", "audit",
                                    consumer_type=pulsar.ConsumerType.Shared,
                                    consumer_name="auditor", batch_index_ack_enabled=True,
                                    initial_position=pulsar.InitialPosition.Earliest)
        for _ in range(100):  # (batch-index acks: batches acknowledged in part count)
            consumer.acknowledge(consumer.receive(timeout_millis=int(scaled(30) * 1000)))
        path = f"{topic}/partitioned-stats?perPartition=true"
        # the client sends its acks grouped (every 100 ms): the backlog falls soon after
        wait_for(lambda: _call(b, "GET", path)[1]["subscriptions"]["audit"]["msgBacklog"]
                 == 200, timeout=scaled(30), what="the backlog to reach 200")
        status, stats = _call(b, "GET", path)
        assert status == 200 and stats["metadata"] == {"partitions": 3}
        assert stats["msgInCounter"] == 300 and stats["storageSize"] > 0
        # one per partition, each named by the broker (the client gave no name)
        names = [p["producerName"] for p in stats["publishers"]]
        assert len(set(names)) == 3 and producer.producer_name() in names
        audit = stats["subscriptions"]["audit"]
        assert audit["type"] == "Shared" and audit["msgBacklog"] == 200
        assert [c["consumerName"] for c in audit["consumers"]] == ["auditor"]
        assert sorted(stats["partitions"]) == [
            f"persistent://public/default/clicks-partition-{i}" for i in range(3)]
        assert sum(p["msgInCounter"] for p in stats["partitions"].values()) == 300
        assert sum(p["subscriptions"]["audit"]["msgBacklog"]
                   for p in stats["partitions"].values()) == 200
        status, one = _call(b, "GET", f"{topic}-partition-1/stats")
        assert status == 200 and one == stats["partitions"][
            "persistent://public/default/clicks-partition-1"] | {
            k: one[k] for k in ("publishers", "msgRateIn", "msgThroughputIn", "msgRateOut",
                                "msgThroughputOut", "averageMsgSize")}
        assert _call(b, "GET", f"{topic}-partition-7/stats")[0] == 404
        assert _call(b, "GET", f"{topic}/subscriptions") == (200, ["audit"])

        status, answer = _call(b, "DELETE", f"{topic}/subscription/audit")
        assert status == 412 and "auditor" in answer["reason"]
        consumer.close()
        assert _call(b, "DELETE", f"{topic}/subscription/audit") == (204, None)
        assert _call(b, "GET", f"{topic}/subscriptions") == (200, [])
        assert _call(b, "DELETE", f"{topic}/subscription/audit")[0] == 404

        # grown over REST: a scale event, which the producer sees at its next poll
        assert _call(b, "POST", f"{topic}/partitions", 6) == (204, None)
        assert _call(b, "GET", f"{topic}/partitions") == (200, {"partitions": 6})
        status, answer = _call(b, "POST", f"{topic}/partitions", 2)
        assert status == 400 and "2" in answer["reason"], answer
        producer.close()
    finally:
        client.close()
    assert _call(b, "DELETE", f"{topic}/partitions") == (204, None)
    assert _call(b, "GET", f"{topic}/partitions")[0] == 404
    assert b.tracebacks == []


def test_bad_requests_are_answered_with_pulsars_status_and_a_reason(admin_broker) -> None:
    b = admin_broker
    for method, path, status, needle in [
            ("GET", "persistent/public", 404, "expected"),
            ("GET", "clusters", 404, "/admin/v2/persistent/"),
            ("GET", "non-persistent/public/default/t/stats", 501, "non-persistent"),
            ("GET", "persistent/public/default/a%20b/stats", 412, "a b"),
            ("GET", "persistent/public/default/nope/stats", 404, "nope"),
            ("PUT", "persistent/public/default/t/stats", 405, "not part"),
            ("PUT", "persistent/public/default/t-partition-2/partitions", 412, "one partition")]:
        got, answer = _call(b, method, path, b"2" if method == "PUT" else None)
        assert got == status and needle in answer["reason"], (path, got, answer)
    assert b.tracebacks == []


def test_with_a_token_every_admin_call_needs_it(start_broker) -> None:
    b = start_broker("--admin-port", str(free_port()), "--auth-token", "s3cret")
    status, answer = _call(b, "GET", "persistent/public/default")
    assert status == 401 and "Bearer" in answer["reason"]
    assert _call(b, "GET", "persistent/public/default", token="wrong")[0] == 401
    assert _call(b, "GET", "persistent/public/default", token="s3cret") == (200, [])


def test_an_admin_port_in_use_is_one_line_naming_the_option(tmp_path) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run([sys.executable, "-m", "tierstream", "broker", "start",
                               "--data-dir", str(tmp_path / "d"), "--port", "0",
                               "--pulsar-port", "0", "--admin-port", str(port)],
                              capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"in use on this host: {port} (--admin-port" in proc.stderr, proc.stderr
    assert not (tmp_path / "d").exists()  # nothing half-created


def test_one_partition_by_its_name_is_a_topic_of_its_own_to_a_pulsar_client(
        admin_broker) -> None:
    """Regression: a consumer, reader or producer of ``...-partition-1`` (what Pulsar's
    Flink and Spark connectors and Pulsar IO use) failed with TopicNotFound: partitioned
    metadata for a partition's name answered the parent's count, so the client looked up
    ``...-partition-1-partition-0``. Pulsar answers 0: the partition is a topic of its own."""
    assert _call(admin_broker, "PUT", "persistent/acme/named/orders/partitions", 3)[0] == 204
    one = "persistent://acme/named/orders-partition-1"
    client = client_of(admin_broker)
    try:
        assert client.get_topic_partitions(one) == [one]
        producer = client.create_producer(one, batching_enabled=False)
        for i in range(5):
            producer.send(f"m{i}".encode())
        producer.flush()
        consumer = client.subscribe(one, "by-name", consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        got = [consumer.receive(timeout_millis=int(scaled(15) * 1000)) for _ in range(5)]
        assert [m.data() for m in got] == [f"m{i}".encode() for i in range(5)]
        for m in got:
            consumer.acknowledge(m)
        assert consumer.get_last_message_id() == got[-1].message_id()
        consumer.seek(pulsar.MessageId.earliest)  # everything again
        again = consumer.receive(timeout_millis=int(scaled(15) * 1000))
        assert again.data() == b"m0"
        reader = client.create_reader(one, pulsar.MessageId.earliest)
        read = [reader.read_next(timeout_millis=int(scaled(15) * 1000)).data()
                for _ in range(5)]
        assert read == [f"m{i}".encode() for i in range(5)]
        assert not reader.has_message_available()
        # only partition 1 got them: the others are empty
        with pytest.raises(pulsar.Timeout):
            client.create_reader("persistent://acme/named/orders-partition-0",
                                 pulsar.MessageId.earliest).read_next(timeout_millis=500)
        # past the last partition: not found, as Pulsar's
        with pytest.raises(pulsar.TopicNotFound):
            client.create_producer("persistent://acme/named/orders-partition-3")
    finally:
        client.close()
    # the admin REST calls take a partition's name too
    assert _call(admin_broker, "GET", "persistent/acme/named/orders-partition-1/partitions") \
        == (200, {"partitions": 0})
    status, subs = _call(admin_broker, "GET",
                         "persistent/acme/named/orders-partition-1/subscriptions")
    assert status == 200 and "by-name" in subs, subs
    assert _call(admin_broker, "GET",
                 "persistent/acme/named/orders-partition-3/partitions")[0] == 404


def test_deleting_a_topic_with_clients_attached_is_refused_412(admin_broker) -> None:
    """Regression: a DELETE over REST answered 204 and deleted the topic under a connected
    consumer; Pulsar refuses it with 412 while producers or consumers are attached (and
    tierstream does not serve force=true: 501, the topic left alone)."""
    assert _call(admin_broker, "PUT", "persistent/acme/gone/t/partitions", 2)[0] == 204
    client = client_of(admin_broker)
    try:
        consumer = client.subscribe("persistent://acme/gone/t", "s")
        status, answer = _call(admin_broker, "DELETE", "persistent/acme/gone/t/partitions")
        assert status == 412 and "active" in answer["reason"], answer
        status, answer = _call(admin_broker, "DELETE",
                               "persistent/acme/gone/t/partitions?force=true")
        assert status == 501 and "force" in answer["reason"], answer
        assert _call(admin_broker, "GET", "persistent/acme/gone/t/partitions") \
            == (200, {"partitions": 2})
        consumer.close()
        wait_for(lambda: _call(admin_broker, "DELETE",
                               "persistent/acme/gone/t/partitions")[0] == 204,
                 timeout=scaled(30), what="the topic deleted once its consumer left")
    finally:
        client.close()
    assert _call(admin_broker, "GET", "persistent/acme/gone/t/partitions")[0] == 404


def test_stats_cover_the_partitions_a_growth_announced_to_pulsar_clients(start_broker) -> None:
    """Regression: while a growth was announced (Pulsar clients already writing to the new
    partitions, for up to --client-refresh-wait), ``partitioned-stats`` said the old count
    and left the new partitions' messages out, and a new partition's ``stats`` was a 404,
    though ``partitions`` and the binary protocol gave the new count."""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port()),
                                         "--admin-port", str(free_port()),
                                         "--client-refresh-wait", "1h")
    topic, name = "persistent/public/default/growing", "persistent://public/default/growing"
    assert _call(broker, "PUT", f"{topic}/partitions", 2) == (204, None)
    client = client_of(broker)
    try:
        def send(partition: int, keys: list[str]) -> None:
            producer = client.create_producer(f"{name}-partition-{partition}",
                                              batching_enabled=False)
            for key in keys:
                producer.send(key.encode(), partition_key=key)
            producer.close()

        # keys put where tierstream's hash would not: the clients route this topic's keys
        send(0, [f"k{i}" for i in range(10)])
        assert _call(broker, "POST", f"{topic}/partitions", 4) == (204, None)
        with Admin(broker.url) as admin:  # announced, not recorded: tierstream reads 2 still
            record = admin.get_topic("public/default/growing")
            assert (record.key_routing, record.partitions, record.announced) == ("client", 2, 4)
        assert _call(broker, "GET", f"{topic}/partitions") == (200, {"partitions": 4})
        send(3, ["k0", "k1"])
    finally:
        client.close()
    status, stats = _call(broker, "GET", f"{topic}/partitioned-stats?perPartition=true")
    assert status == 200 and stats["metadata"] == {"partitions": 4}, stats
    assert stats["msgInCounter"] == 12, stats
    assert sorted(stats["partitions"]) == [f"{name}-partition-{i}" for i in range(4)]
    assert stats["partitions"][f"{name}-partition-3"]["msgInCounter"] == 2
    status, one = _call(broker, "GET", f"{topic}-partition-3/stats")
    assert status == 200 and one["msgInCounter"] == 2, one
    assert _call(broker, "GET", f"{topic}-partition-4/stats")[0] == 404
    with Admin(broker.url) as admin:  # tierstream's own stats: all that is stored, and why
        own = admin.topic_stats("public/default/growing", per_partition=True)
        assert (own["partition_count"], own["announced"], len(own["partitions"])) == (2, 4, 4)


def test_a_client_given_the_http_service_url_looks_topics_up_over_http(admin_broker) -> None:
    """Regression: a Pulsar application configured with ``http://host:8080`` as its service
    URL (Pulsar's HTTP lookup) failed with ConnectError: ``/lookup/v2/topic/...`` was 404."""
    b = admin_broker
    assert _call(b, "PUT", "persistent/public/default/orders/partitions", 2) == (204, None)
    lookup = "/lookup/v2/topic/persistent/public/default"
    status, answer = _http(b, f"{lookup}/orders-partition-1")
    assert (status, answer["brokerUrl"], answer["nativeUrl"]) == \
        (200, b.pulsar_url, b.pulsar_url)
    assert _http(b, f"{lookup}/orders-partition-2")[0] == 404  # past the last partition
    client = client_of(b, url=b.admin_url)
    try:
        for topic in ("orders", "created-by-its-first-producer"):  # the second auto-created
            name = f"persistent://public/default/{topic}"
            producer = client.create_producer(name, batching_enabled=False)
            for i in range(10):
                producer.send(f"{topic} {i}".encode(), partition_key=f"k{i}")
            producer.close()
            consumer = client.subscribe(name, "http-audit",
                                        initial_position=pulsar.InitialPosition.Earliest)
            got = sorted(consumer.receive(timeout_millis=int(scaled(30) * 1000)).data()
                         for _ in range(10))
            assert got == sorted(f"{topic} {i}".encode() for i in range(10))
            consumer.close()
    finally:
        client.close()
    assert _call(b, "GET", "persistent/public/default/created-by-its-first-producer/"
                 "partitions") == (200, {"partitions": 0})


def _http(broker: BrokerProcess, path: str) -> tuple[int, Any]:
    """(status, JSON) of a GET outside the admin prefix."""
    try:
        with urllib.request.urlopen(f"{broker.admin_url}{path}", timeout=scaled(30)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_compaction_over_rest_starts_a_run_and_tells_its_status(admin_broker) -> None:
    b = admin_broker
    topic = "persistent/public/default/prices"
    assert _call(b, "PUT", f"{topic}/partitions", 2) == (204, None)
    assert _call(b, "GET", f"{topic}/compaction") == (200, {"status": "NOT_RUN",
                                                           "lastError": ""})
    with Producer("public/default/prices", broker=b.url) as producer:
        producer.send_many({"key": f"k{i % 7}", "value": b"v"} for i in range(100))
    assert _call(b, "PUT", f"{topic}/compaction") == (204, None)
    wait_for(lambda: _call(b, "GET", f"{topic}/compaction")[1]["status"] == "SUCCESS",
             timeout=scaled(30), what="the compaction to succeed")
    status, answer = _call(b, "PUT", "persistent/public/default/nothing/compaction")
    assert status == 404 and "nothing" in answer["reason"], answer
