"""A partition owned by another broker (``metadata/ownership.py``), as real Pulsar clients see
it: a LOOKUP sends them there (Redirect, as Pulsar's brokers do; the HTTP lookup names it
too), and a producer that names it to this broker anyway is refused with ServiceNotReady
naming the owner."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pulsar
import pyarrow as pa

from tierstream.broker.config import DataDir
from tierstream.broker.process import BrokerProcess
from tierstream.broker.pulsar.server import PulsarServer
from tierstream.client import Admin, Producer
from tierstream.metadata.ownership import PartitionOwners
from tierstream.metadata.store import MetadataStore
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame
from tierstream.wire.security import advertised_host

from ..logs import running_log
from ..postgres import started
from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import client_of, commands_until, free_port, rows_of

TOPIC = "acme/owners/orders"
NAME = f"persistent://{TOPIC}"
#: what a broker says when its lease's renewal finds a partition owned elsewhere
LOST = "lost 1 partition(s) to other brokers"


def _given_away(data_dir: Path, owner: BrokerProcess) -> None:
    """In the metadata of the broker on ``data_dir``, partition 1 is owned by ``owner``: as a
    newer broker that took it over would have claimed it."""
    metadata = MetadataStore(DataDir.at(data_dir).metadata)
    try:
        newer = PartitionOwners(metadata, "broker-99", 99)
        newer.advertise(owner.url or "", owner.pulsar_url, owner.admin_url)
        newer.claim([(TOPIC, 1)])
    finally:
        metadata.close()


def _two_brokers(start_broker: Any, tmp_path: Path, *here_args: str
                 ) -> tuple[BrokerProcess, BrokerProcess]:
    """(owner, here): two brokers on stores of their own, each with the 2-partition topic."""
    owner = start_broker("--pulsar-port", str(free_port()), data=tmp_path / "owner")
    here = start_broker("--pulsar-port", str(free_port()), *here_args, data=tmp_path / "here")
    for broker in (owner, here):
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 2)
    return owner, here


def _send(broker: BrokerProcess, prefix: str, n: int) -> None:
    """``n`` values ``<prefix><i>`` keyed ``k<i>``, by a new Pulsar client of ``broker``."""
    client = client_of(broker)
    try:
        producer = client.create_producer(NAME, batching_enabled=False)
        for i in range(n):
            producer.send(f"{prefix}{i}".encode(), partition_key=f"k{i}")
        producer.close()
    finally:
        client.close()


def _answer(broker: BrokerProcess, *commands: api.BaseCommand) -> api.BaseCommand:
    """The first answer to ``commands`` (after CONNECT) that is not CONNECTED."""
    host, port = (broker.pulsar_url or "").removeprefix("pulsar://").rsplit(":", 1)
    connect = api.BaseCommand(type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
        client_version="t", protocol_version=20))
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(b"".join(command_frame(c) for c in (connect, *commands)))
        got = commands_until(sock, lambda cs: any(
            c.type != api.BaseCommand.CONNECTED for c in cs))
    return next(c for c in got if c.type != api.BaseCommand.CONNECTED)


def test_a_lookup_sends_a_pulsar_client_to_the_broker_owning_the_partition(
        start_broker: Any, tmp_path: Path) -> None:
    owner, here = _two_brokers(start_broker, tmp_path, "--admin-port", str(free_port()))
    _given_away(tmp_path / "here", owner)
    # a producer is refused by what the lease's last renewal read (no metadata read)
    wait_for(lambda: any(LOST in line for line in here.stderr_tail),
             what="the renewal to see partition 1 owned elsewhere")

    lookup = _answer(here, api.BaseCommand(
        type=api.BaseCommand.LOOKUP, lookupTopic=api.CommandLookupTopic(
            topic=f"{NAME}-partition-1", request_id=1)))
    reply = lookup.lookupTopicResponse
    assert (reply.response, reply.brokerServiceUrl, reply.authoritative) == \
        (reply.Redirect, owner.pulsar_url, True)
    for partition, where in ((0, here), (1, owner)):  # Pulsar's HTTP lookup answers alike
        url = f"{here.admin_url}/lookup/v2/topic/persistent/{TOPIC}-partition-{partition}"
        with urllib.request.urlopen(url, timeout=scaled(30)) as answer:
            assert json.loads(answer.read())["brokerUrl"] == where.pulsar_url
    refused = _answer(here, api.BaseCommand(
        type=api.BaseCommand.PRODUCER, producer=api.CommandProducer(
            topic=f"{NAME}-partition-1", producer_id=1, request_id=1)))
    assert refused.type == api.BaseCommand.ERROR
    assert refused.error.error == api.ServiceNotReady
    assert f"served by broker-99 at {owner.url} (epoch 99)" in refused.error.message

    _send(here, "v", 40)  # a client given this broker's address only
    # partition 1 was written where the lookup sent the client, partition 0 here; a read at
    # here follows partition 1 to its owner
    here_rows, owner_rows = rows_of(here, TOPIC), rows_of(owner, TOPIC)
    assert {r["partition"] for r in owner_rows} == {1}
    assert [r for r in here_rows if r["partition"] == 1] == owner_rows
    assert sorted(r["value"] for r in here_rows) == sorted(f"v{i}".encode() for i in range(40))


def test_a_partition_s_admin_stats_asked_of_any_broker_are_answered_by_its_owner(
        start_broker: Any, tmp_path: Path) -> None:
    """Pulsar's admin REST of one partition (``.../topic-partition-1/stats``) asked of a
    broker that does not own it: a 307 to the owner's admin REST, as Pulsar's brokers answer,
    which admin clients follow. Before, the broker answered its own stale view."""
    owner, here = (start_broker("--admin-port", str(free_port()), data=tmp_path / name)
                   for name in ("owner", "here"))
    for broker in (owner, here):
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 2)
    assert owner.admin_url is not None and here.admin_url is not None
    with Producer(TOPIC, broker=owner.url) as producer:
        producer.send_batch(pa.record_batch({"value": [b"m"] * 7}), partition=1)
    _given_away(tmp_path / "here", owner)
    wait_for(lambda: any(LOST in line for line in here.stderr_tail),
             what="the renewal to see partition 1 owned elsewhere")
    path = f"/admin/v2/persistent/{TOPIC}-partition-1/stats"

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None  # the 307 itself, not where it leads

    try:
        urllib.request.build_opener(Stay).open(here.admin_url + path, timeout=scaled(30))
        raise AssertionError("no redirect")
    except urllib.error.HTTPError as exc:
        assert exc.code == 307 and exc.headers["Location"] == owner.admin_url + path
    with urllib.request.urlopen(here.admin_url + path, timeout=scaled(30)) as answer:
        followed = json.loads(answer.read())
    assert followed["msgInCounter"] == 7  # the owner's partition, not here's (empty) one
    with urllib.request.urlopen(here.admin_url + f"/admin/v2/persistent/{TOPIC}-partition-0"
                                "/stats", timeout=scaled(30)) as answer:
        assert json.loads(answer.read())["msgInCounter"] == 0  # its own, answered here


def test_a_pulsar_consumer_of_a_partition_taken_over_is_let_go_and_finds_the_owner(
        start_broker: Any, tmp_path: Path) -> None:
    """A real Pulsar consumer subscribed to partition 1 at ``here``; ``here`` then loses the
    partition (its lease's renewal sees ``owner``'s claim). The consumer is told
    CLOSE_CONSUMER, looks the partition up again, is sent to the owner, and receives what is
    produced there."""
    owner, here = _two_brokers(start_broker, tmp_path)
    client = client_of(here)
    try:
        consumer = client.subscribe(f"{NAME}-partition-1", "audit",
                                    initial_position=pulsar.InitialPosition.Earliest)
        _given_away(tmp_path / "here", owner)
        with Producer(TOPIC, broker=owner.url) as producer:
            producer.send_batch(pa.record_batch({"value": [b"at-the-owner"]}), partition=1)
        msg = consumer.receive(timeout_millis=int(scaled(30) * 1000))
        assert msg.data() == b"at-the-owner"
        consumer.acknowledge(msg)
    finally:
        client.close()
    assert any(LOST in line for line in here.stderr_tail), list(here.stderr_tail)[-5:]


def test_a_listener_bound_to_every_interface_answers_lookups_with_the_host_name(
        tmp_path: Path) -> None:
    """0.0.0.0 means nothing to another machine: a Pulsar listener bound to every interface
    without --advertised-address answers LOOKUP with this machine's host name (as Pulsar's
    brokers advertise theirs), not with 0.0.0.0 — a client on another host followed that to
    itself and never connected. Given --advertised-address, it answers that."""
    with running_log(tmp_path / "data") as log:
        pieces = {"schemas": log.broker.schemas, "subscriptions": log.broker.subscriptions,
                  "streams": log.broker.streams, "auth_token": "t"}
        for advertised, named in ((None, socket.gethostname()),
                                  ("store-1.internal", "store-1.internal")):
            server = PulsarServer(log.store, host="0.0.0.0", port=0, advertised=advertised,
                                  **pieces)
            try:
                assert server.url == f"pulsar://{named}:{server.port}"
                assert server.listener.url == server.url  # what LOOKUP answers
            finally:
                server.shutdown()
    assert advertised_host("::", None) == socket.gethostname()
    assert advertised_host("10.0.0.5", None) == "10.0.0.5"


def test_pulsar_clients_look_up_subscribe_and_produce_while_postgresql_is_down(
        start_broker: Any, tmp_path: Path) -> None:
    """Regression: LOOKUP, PARTITIONED_METADATA and SUBSCRIBE read the partition's owner and
    the topic's record from the metadata store, so a Pulsar client could not (re)connect
    while PostgreSQL was down, though what it reads and writes needs no metadata. The owner
    is now the lease's last renewal's, as for Flight streams, and the topic's record the
    last one read while the metadata store is unreachable (a statement that finds it so
    waits, as before). What needs a metadata write still waits: a new subscription, a
    topic's first key routed by a Pulsar client, a segment roll."""
    server = started()  # a server of its own: the test stops it
    try:
        broker = start_broker("--pulsar-port", str(free_port()), "--metadata",
                              server.new_database(), "--no-fsync", data=tmp_path / "broker")
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 2)

        client = client_of(broker)
        try:  # the subscription, and the topic's routing by its Pulsar clients, before
            client.subscribe(NAME, "audit",
                             initial_position=pulsar.InitialPosition.Earliest).close()
        finally:
            client.close()
        _send(broker, "v", 20)
        server.halt()
        # its metadata statements find the server gone (not only its lock's session)
        wait_for(lambda: any("metadata.postgres: " in line and "is unreachable" in line
                             for line in broker.stderr_tail),
                 what="the broker to find PostgreSQL gone")
        _send(broker, "w", 20)  # a new client's producer
        client = client_of(broker)
        try:
            consumer = client.subscribe(NAME, "audit")
            got = [consumer.receive(timeout_millis=int(scaled(30) * 1000)).data()
                   for _ in range(40)]
        finally:
            client.close()
        assert sorted(got) == sorted(f"{p}{i}".encode() for p in "vw" for i in range(20))
        server.resume()
    finally:
        server.stop()
