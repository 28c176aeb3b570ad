"""Pulsar's wire protocol, part 1, with the real pulsar-client wheel as the oracle: connect,
look up, produce; what Pulsar clients write is what tierstream's readers read."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
from typing import Any

import crc32c
import pulsar
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, read
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol import key_router
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame

from ..timing import scaled
from .helpers import client_of, commands_until, own_properties, rows_of

COMPRESSIONS = [pulsar.CompressionType.NONE, pulsar.CompressionType.LZ4,
                pulsar.CompressionType.ZLib, pulsar.CompressionType.ZSTD,
                pulsar.CompressionType.SNAPPY]


def test_batched_and_single_sends_with_every_compression_are_read_as_sent(
        pulsar_broker: BrokerProcess) -> None:
    topic = "acme/web/pulsar"
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic(topic, 4)
    client = client_of(pulsar_broker)
    sent: dict[str, tuple[str, dict[str, str], int]] = {}
    ids: dict[str, Any] = {}
    try:
        for c, compression in enumerate(COMPRESSIONS):
            for batching in (True, False):
                producer = client.create_producer(
                    f"persistent://{topic}", compression_type=compression,
                    batching_enabled=batching, message_router=key_router)
                for i in range(120 if batching else 12):
                    value = f"{c}-{batching}-{i}-" + "x" * (i % 50)
                    key, props, event = f"user-{i % 13}", {"i": str(i)}, 1_000 + i
                    sent[value] = (key, props, event)

                    def done(result: Any, message_id: Any, value: str = value) -> None:
                        ids[value] = (result, message_id)

                    producer.send_async(value.encode(), done, partition_key=key,
                                        properties=props, event_timestamp=event)
                producer.flush()
                producer.close()
    finally:
        client.close()
    assert {str(r) for r, _ in ids.values()} == {"Result.Ok"} and len(ids) == len(sent)
    rows = rows_of(pulsar_broker, topic)
    assert sorted(r["value"].decode() for r in rows) == sorted(sent)  # each exactly once
    for r in rows:
        value = r["value"].decode()
        key, props, event = sent[value]
        assert (r["key"], own_properties(r), r["event_time"]) == (key, props, event)
        mid = ids[value][1]  # the receipt's id is tierstream's position
        assert (mid.ledger_id(), mid.entry_id(), mid.partition()) == (
            r["segment_id"], r["entry_id"], r["partition"])
        assert mid.batch_index() in (r["batch_index"], -1)


def test_short_names_are_created_in_public_default_and_non_persistent_is_refused(
        pulsar_broker: BrokerProcess) -> None:
    client = client_of(pulsar_broker)
    try:
        producer = client.create_producer("orders")
        message_id = producer.send(b"hello", partition_key="k")
        with pytest.raises(Exception, match="NotAllowed"):
            client.create_producer("non-persistent://public/default/orders")
    finally:
        client.close()
    rows = rows_of(pulsar_broker, "public/default/orders")
    assert [(r["value"], r["key"]) for r in rows] == [(b"hello", "k")]
    assert (message_id.ledger_id(), message_id.entry_id(), message_id.partition()) == (
        rows[0]["segment_id"], rows[0]["entry_id"], -1)


def test_a_named_producer_resumes_after_its_last_stored_sequence_id(
        pulsar_broker: BrokerProcess) -> None:
    client = client_of(pulsar_broker)
    try:
        first = client.create_producer("public/default/named", producer_name="importer")
        for i in range(10):
            first.send(f"m{i}".encode())
        first.close()
        again = client.create_producer("public/default/named", producer_name="importer")
        assert again.last_sequence_id() == 9  # PRODUCER_SUCCESS says where it stopped
        again.send(b"m3", sequence_id=3)  # a replay of a stored one: not stored again
        again.send(b"m10")
        again.close()
    finally:
        client.close()
    values = [r["value"] for r in rows_of(pulsar_broker, "public/default/named")]
    assert values == [f"m{i}".encode() for i in range(11)]


def test_ids_a_client_numbers_from_0_again_are_stored_and_a_resend_is_not(
        pulsar_broker: BrokerProcess) -> None:
    """Regression: the C++ core numbers messages queued before its producer's first
    PRODUCER_SUCCESS from 0, then from 0 again (pulsar-client-cpp#341: a partitioned
    producer's new partitions after a growth); the broker dropped the second ones as
    duplicates and sent their receipts — acknowledged, not stored (found by
    ``python -m tests.pulsar_wire.scale_follow --producer pulsar``). A resend on a new
    session, and an explicit repeat of an id that does not restart at 0, stay de-duplicated."""
    from tierstream.pulsar_protocol.frames import payload_frame

    topic = "public/default/renumbered"
    host, port = str(pulsar_broker.pulsar_url).removeprefix("pulsar://").rsplit(":", 1)

    def session(name: str, sends: list[tuple[int, bytes]]) -> list[int]:
        frames = [command_frame(api.BaseCommand(type=api.BaseCommand.CONNECT, connect=(
                      api.CommandConnect(client_version="t", protocol_version=20)))),
                  command_frame(api.BaseCommand(type=api.BaseCommand.PRODUCER, producer=(
                      api.CommandProducer(topic=topic, producer_id=1, request_id=1,
                                          producer_name=name))))]
        for seq, value in sends:
            frames.append(payload_frame(
                api.BaseCommand(type=api.BaseCommand.SEND, send=api.CommandSend(
                    producer_id=1, sequence_id=seq)),
                api.MessageMetadata(producer_name=name, sequence_id=seq, publish_time=1),
                value))
        with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
            sock.sendall(b"".join(frames))
            got = commands_until(sock, lambda cs: sum(
                c.type == api.BaseCommand.SEND_RECEIPT for c in cs) == len(sends))
        return [c.send_receipt.sequence_id for c in got
                if c.type == api.BaseCommand.SEND_RECEIPT]

    assert session("renumbered", [(0, b"a"), (1, b"b"), (0, b"c"), (1, b"d"), (2, b"e")]) \
        == [0, 1, 0, 1, 2]
    assert session("renumbered", [(2, b"e")]) == [2]  # resent after a reconnect
    assert session("explicit", [(5, b"x"), (5, b"x")]) == [5, 5]  # the application's repeat
    assert [r["value"] for r in rows_of(pulsar_broker, topic)] == [b"a", b"b", b"c", b"d",
                                                                  b"e", b"x"]


def test_on_a_topic_that_grew_a_key_routed_elsewhere_than_tierstream_routes_it_is_refused(
        pulsar_broker: BrokerProcess) -> None:
    """Across a topic's scale events readers find a key where tierstream's hash puts it: on
    a topic that grew, a Pulsar producer whose router puts a key elsewhere is refused, and
    nothing of it is stored (on one that never grew it is stored where the client routes
    it: test_pulsar_routing.py)."""
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic("acme/web/routed", 2)
        admin.set_partitions("acme/web/routed", 4)
    client = client_of(pulsar_broker)
    try:
        producer = client.create_producer("persistent://acme/web/routed",
                                          batching_enabled=False,
                                          message_router=lambda m, n: 0)
        refused = 0
        for i in range(50):  # some of these keys belong to another partition than 0
            try:
                producer.send(b"v", partition_key=f"k{i}")
            except Exception as exc:  # answered at once, the connection kept
                assert "Checksum" in str(exc), exc
                refused += 1
        assert 0 < refused < 50
    finally:
        client.close()
    stored = rows_of(pulsar_broker, "acme/web/routed")
    assert all(r["partition"] == 0 for r in stored)
    from tierstream.model.message_format import key_hash

    assert all(key_hash(r["key"]) % 4 == 0 for r in stored)
    with Admin(pulsar_broker.url) as admin:
        assert admin.get_topic("acme/web/routed").key_routing == "tierstream"


def _frame_with_payload(command: api.BaseCommand, payload: bytes, *,
                        checksum: int | None = None, **metadata: Any) -> bytes:
    data = command.SerializeToString()
    meta = api.MessageMetadata(**{"producer_name": "p", "sequence_id": 0, "publish_time": 1,
                                  **metadata})
    meta_bytes = meta.SerializeToString()
    rest = struct.pack(">I", len(meta_bytes)) + meta_bytes + payload
    if checksum is None:
        checksum = crc32c.crc32c(rest)
    body = struct.pack(">I", len(data)) + data + struct.pack(">HI", 0x0E01, checksum) + rest
    return struct.pack(">I", len(body)) + body


def test_send_answers_keep_the_order_of_the_sends_and_an_oversized_one_keeps_the_connection(
        pulsar_broker: BrokerProcess) -> None:
    """Regression: a refused send was answered at once while the receipts of the sends before
    it waited for their quorum; clients fail the message at the head of their queue on
    SEND_ERROR, so it failed the wrong one (the C++ core crashed on it). And a frame over
    max_message_size is refused, the connection kept."""
    host, port = pulsar_broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    frames = [command_frame(api.BaseCommand(
        type=api.BaseCommand.CONNECT, connect=api.CommandConnect(client_version="t",
                                                                 protocol_version=20))),
              command_frame(api.BaseCommand(type=api.BaseCommand.PRODUCER,
                                            producer=api.CommandProducer(
                                                topic="public/default/ordered",
                                                producer_id=1, request_id=1)))]
    expected = []
    for seq in range(40):
        send = api.BaseCommand(type=api.BaseCommand.SEND,
                               send=api.CommandSend(producer_id=1, sequence_id=seq))
        if seq == 30:  # 6 MB: over the 5 MB a message may have
            frames.append(_frame_with_payload(send, b"x" * (6 << 20), sequence_id=seq))
            expected.append((api.BaseCommand.SEND_ERROR, seq))
        elif seq % 3 == 1:  # encryption: refused by name
            frames.append(_frame_with_payload(send, b"secret", sequence_id=seq,
                                              encryption_algo="RSA"))
            expected.append((api.BaseCommand.SEND_ERROR, seq))
        else:
            frames.append(_frame_with_payload(send, f"m{seq}".encode(), sequence_id=seq))
            expected.append((api.BaseCommand.SEND_RECEIPT, seq))
    kinds = (api.BaseCommand.SEND_RECEIPT, api.BaseCommand.SEND_ERROR)
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(b"".join(frames))  # all at once: nothing waits for an answer
        got = commands_until(sock, lambda cs: sum(c.type in kinds for c in cs) == len(expected))
    answers = [(c.type, (c.send_receipt if c.type == api.BaseCommand.SEND_RECEIPT
                         else c.send_error).sequence_id) for c in got if c.type in kinds]
    assert answers == expected
    oversized = next(c.send_error for c in got if c.type == api.BaseCommand.SEND_ERROR
                     and c.send_error.sequence_id == 30)
    assert "over the 5,242,880 bytes" in oversized.message
    stored = [r["value"] for r in rows_of(pulsar_broker, "public/default/ordered")]
    assert stored == [f"m{s}".encode() for _, s in expected if _ == api.BaseCommand.SEND_RECEIPT]


def test_malformed_frames_are_answered_or_dropped_and_the_broker_serves_on(
        pulsar_broker: BrokerProcess) -> None:
    host, port = pulsar_broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    rng = random.Random(7)
    connect = command_frame(api.BaseCommand(type=api.BaseCommand.CONNECT,
                                            connect=api.CommandConnect(client_version="t",
                                                                       protocol_version=20)))
    producer = command_frame(api.BaseCommand(
        type=api.BaseCommand.PRODUCER, producer=api.CommandProducer(
            topic="public/default/fuzz", producer_id=1, request_id=1)))
    bad_checksum = _frame_with_payload(api.BaseCommand(
        type=api.BaseCommand.SEND, send=api.CommandSend(producer_id=1, sequence_id=0)),
        b"payload", checksum=12345)
    cases = [bad_checksum, struct.pack(">I", 10) + b"\x00" * 3,  # truncated
             struct.pack(">I", 64 * 1024 * 1024),  # over the maximum
             command_frame(api.BaseCommand(type=api.BaseCommand.SUBSCRIBE))]  # not yet
    cases += [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200)))
              for _ in range(30)]
    answers = []
    for case in cases:
        with socket.create_connection((host, int(port)), timeout=scaled(5)) as sock:
            sock.sendall(connect + producer + case)
            with contextlib.suppress(OSError):  # the broker may have closed it already
                sock.shutdown(socket.SHUT_WR)
            data = b""
            try:
                while chunk := sock.recv(65536):
                    data += chunk
            except OSError:
                pass
            answers.append(data)
    assert b"checksum mismatch" in answers[0]  # SEND_ERROR ChecksumError, nothing stored
    assert all(b"tierstream-" in a for a in answers)  # each got CONNECTED at least
    assert pulsar_broker.proc is not None and pulsar_broker.proc.poll() is None
    client = client_of(pulsar_broker)  # the broker is unharmed
    try:
        client.create_producer("public/default/fuzz").send(b"after")
    finally:
        client.close()
    assert [r["value"] for r in rows_of(pulsar_broker, "public/default/fuzz")] == [b"after"]


def test_without_auto_creation_a_missing_topic_is_not_found_and_bad_names_are_named(
        start_broker, free_port) -> None:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port),
                                         "--no-allow-auto-topic-creation")
    client = client_of(broker, operation_timeout_seconds=int(scaled(5)))
    try:
        with pytest.raises(pulsar.TopicNotFound):
            client.create_producer("public/default/missing")
        with Admin(broker.url) as admin:
            assert [t.name for t in admin.list_topics("public/default")] == []
            admin.create_topic("public/default/missing", 1)
        client.create_producer("public/default/missing").send(b"now it exists")
    finally:
        client.close()
    host, port = broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(command_frame(api.BaseCommand(
            type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
                client_version="t", protocol_version=20))) + command_frame(api.BaseCommand(
                    type=api.BaseCommand.PARTITIONED_METADATA,
                    partitionMetadata=api.CommandPartitionedTopicMetadata(
                        topic="persistent://acme//bad", request_id=7))))
        got = commands_until(sock, lambda cs: len(cs) == 2)
    answer = got[1].partitionMetadataResponse
    assert (answer.request_id, answer.error) == (7, api.InvalidTopicName), answer
    assert "acme//bad" in answer.message


def test_a_broker_that_stops_tells_its_producers_to_go(start_broker, free_port) -> None:
    """CLOSE_PRODUCER from the broker: a client then looks the topic up again and reconnects
    (here: the broker is back on the same port, and the producer goes on)."""
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    host, port = broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=scaled(30)) as sock:
        sock.sendall(command_frame(api.BaseCommand(
            type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
                client_version="t", protocol_version=20))) + command_frame(api.BaseCommand(
                    type=api.BaseCommand.PRODUCER, producer=api.CommandProducer(
                        topic="public/default/going", producer_id=5, request_id=1))))
        commands_until(sock, lambda cs: any(c.type == api.BaseCommand.PRODUCER_SUCCESS
                                       for c in cs))
        assert broker.stop() == 0
        got = commands_until(sock, lambda cs: any(c.type == api.BaseCommand.CLOSE_PRODUCER
                                             for c in cs))
    assert [c.close_producer.producer_id for c in got
            if c.type == api.BaseCommand.CLOSE_PRODUCER] == [5]
    broker = start_broker("--pulsar-port", str(free_port))
    client = client_of(broker)
    try:
        producer = client.create_producer("public/default/going")
        producer.send(b"before")
        broker.stop()
        broker = start_broker("--pulsar-port", str(free_port))
        producer.send(b"after")  # reconnected by itself
    finally:
        client.close()
    assert [r["value"] for r in rows_of(broker, "public/default/going")] == [b"before",
                                                                              b"after"]


def test_a_producer_across_a_broker_sigkill_stores_every_acknowledged_message_once(
        start_broker, free_port, tmp_path) -> None:
    """10,000 messages from a named, batching Pulsar producer while the broker is SIGKILLed
    and restarted: the client resends what was not acknowledged (same sequence ids), the
    broker de-duplicates by producer name and sequence id, so everything acknowledged is
    stored exactly once."""
    import threading

    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    client = client_of(broker)
    acked: list[str] = []
    failed: list[str] = []
    try:
        producer = client.create_producer("public/default/kill", producer_name="importer",
                                          batching_enabled=True,
                                          batching_max_publish_delay_ms=5,
                                          block_if_queue_full=True,
                                          send_timeout_millis=int(scaled(60) * 1000))
        lock = threading.Lock()

        def done(result: Any, _: Any, value: str) -> None:
            with lock:
                (acked if str(result) == "Result.Ok" else failed).append(value)

        for i in range(10_000):
            producer.send_async(f"m{i}".encode(), lambda r, m, v=f"m{i}": done(r, m, v))
            if i == 4_000:
                broker.kill()
                broker = start_broker("--pulsar-port", str(free_port))
        producer.flush()
    finally:
        client.close()
    assert not failed and len(acked) == 10_000
    values = [r["value"].decode() for r in rows_of(broker, "public/default/kill")]
    assert sorted(values) == sorted(acked)  # every acknowledged message, each once


def test_a_token_is_checked_and_a_wrong_one_refused(start_broker, free_port) -> None:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port),
                                         "--auth-token", "s3cret")
    good = pulsar.Client(broker.pulsar_url, authentication=pulsar.AuthenticationToken("s3cret"),
                         operation_timeout_seconds=int(scaled(15)))
    try:
        good.create_producer("public/default/secured").send(b"in")
    finally:
        good.close()
    bad = pulsar.Client(broker.pulsar_url, authentication=pulsar.AuthenticationToken("nope"),
                        operation_timeout_seconds=int(scaled(5)))
    try:
        with pytest.raises(Exception, match=r"Authentication|Connect|TimeOut"):
            bad.create_producer("public/default/secured")
    finally:
        bad.close()


def test_pulsar_ssl_with_the_brokers_certificate_checked_against_its_ca(
        start_broker, free_port, tmp_path) -> None:
    """``--tls-cert``: Pulsar clients are served pulsar+ssl on --pulsar-tls-port; a client
    that trusts the CA produces (with the token), one that trusts another CA or speaks plain
    TCP is refused; the plain port stays closed."""
    from ..store.test_tls import make_cert

    cert, key = make_cert(tmp_path)
    other, _ = make_cert(tmp_path, "someone-else")
    broker: BrokerProcess = start_broker("--tls-cert", str(cert), "--tls-key", str(key),
                                         "--pulsar-tls-port", str(free_port),
                                         "--auth-token", "s3cret")
    assert broker.pulsar_url == f"pulsar+ssl://127.0.0.1:{free_port}"
    token = pulsar.AuthenticationToken("s3cret")
    good = client_of(broker, authentication=token, tls_trust_certs_file_path=str(cert),
                     tls_validate_hostname=True)
    try:
        message_id = good.create_producer("public/default/sealed").send(b"over tls")
    finally:
        good.close()
    for kwargs in ({"tls_trust_certs_file_path": str(other)},  # another CA
                   {"url": broker.pulsar_url.replace("pulsar+ssl://", "pulsar://")}):  # plain
        bad = client_of(broker, authentication=token, operation_timeout_seconds=int(scaled(2)),
                        **kwargs)
        try:
            with pytest.raises(Exception, match=r"Connect|TimeOut"):
                bad.create_producer("public/default/sealed")
        finally:
            bad.close()
    rows = [r for b in read("public/default/sealed", broker=broker.url, auth_token="s3cret",
                            tls_ca=str(cert), end=Offset.latest()) for r in b.to_pylist()]
    assert [(r["value"], r["segment_id"], r["entry_id"]) for r in rows] == [
        (b"over tls", message_id.ledger_id(), message_id.entry_id())]


def test_the_readme_example_runs(pulsar_broker: BrokerProcess) -> None:
    import re

    from ..guide import section

    block = re.search(r"```python\n(.*?)```", section("# Pulsar clients"), re.S)
    assert block
    exec(block.group(1).replace("pulsar://127.0.0.1:6650", pulsar_broker.pulsar_url or ""),
         {})
    rows = rows_of(pulsar_broker, "acme/web/clicks")
    assert [(r["value"], r["key"], own_properties(r)) for r in rows] == [
        (b"click", "user-1", {"page": "/"})]
    with Admin(pulsar_broker.url) as admin:  # the example's consumer acknowledged it
        audit = [r for r in admin.subscriptions("acme/web/clicks")
                 if r["subscription"] == "audit"]
    assert [r["type"] for r in audit] == ["key_shared"]


def test_a_pulsar_port_in_use_is_one_line_naming_the_option(tmp_path, free_port) -> None:
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port))
        taken.listen()
        proc = subprocess.run([sys.executable, "-m", "tierstream", "broker", "start",
                               "--data-dir", str(tmp_path / "d"), "--port", "0",
                               "--pulsar-port", str(free_port)],
                              capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: port already in use on this host: {free_port} (--pulsar-port")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "d").exists()  # nothing half-created
    proc = subprocess.run([sys.executable, "-m", "tierstream", "broker", "start",
                           "--data-dir", str(tmp_path / "d"), "--pulsar-tls-port", "6652"],
                          capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--pulsar-tls-port 6652 needs --tls-cert" in proc.stderr
    assert not (tmp_path / "d").exists()
