"""Random and mutated frames at the Pulsar listener for a bounded time: every connection is
answered or closed (none hangs), no request escapes its checks (no traceback in the broker's
log), nothing malformed is stored, the broker serves on. ``make chaos`` runs it for two
minutes (TIERSTREAM_FUZZ_SECONDS; TIERSTREAM_FUZZ_SEED picks another sequence)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import time

import crc32c

from tierstream.broker.process import BrokerProcess
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import command_frame

from ..timing import scaled
from .helpers import client_of, rows_of

TOPIC = "public/default/fuzzed"
_Cmd = api.BaseCommand


def _valid_frames(rng: random.Random) -> list[bytes]:
    """A well-formed conversation: CONNECT, PRODUCER, SENDs (some batched, some compressed
    flags without compression: the broker must refuse those)."""
    frames = [command_frame(_Cmd(type=_Cmd.CONNECT, connect=api.CommandConnect(
                  client_version="fuzz", protocol_version=rng.choice([6, 15, 20, 21])))),
              command_frame(_Cmd(type=_Cmd.PRODUCER, producer=api.CommandProducer(
                  topic=rng.choice([TOPIC, "x", "persistent://a/b/c-partition-9",
                                    "non-persistent://a/b/c"]),
                  producer_id=1, request_id=1)))]
    for seq in range(rng.randint(1, 4)):
        meta = api.MessageMetadata(producer_name="fuzz", sequence_id=seq, publish_time=1,
                                   partition_key=f"k{seq}")
        if rng.random() < 0.3:
            meta.num_messages_in_batch = rng.randint(1, 3)
        if rng.random() < 0.2:
            meta.compression = rng.choice([api.LZ4, api.ZLIB, api.ZSTD, api.SNAPPY])
            meta.uncompressed_size = rng.randint(0, 100)
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        command = _Cmd(type=_Cmd.SEND, send=api.CommandSend(producer_id=1, sequence_id=seq))
        data, meta_bytes = command.SerializeToString(), meta.SerializeToString()
        rest = struct.pack(">I", len(meta_bytes)) + meta_bytes + payload
        body = (struct.pack(">I", len(data)) + data + struct.pack(">HI", 0x0E01,
                                                                  crc32c.crc32c(rest)) + rest)
        frames.append(struct.pack(">I", len(body)) + body)
    return frames


def _mutated(rng: random.Random) -> bytes:
    frames = _valid_frames(rng)
    how = rng.choice(["flip", "truncate", "insert", "drop", "random", "swap"])
    i = rng.randrange(len(frames))
    frame = bytearray(frames[i])
    if how == "flip":
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] ^= rng.randint(1, 255)
    elif how == "truncate":
        frame = frame[:rng.randrange(len(frame))]
    elif how == "insert":
        at = rng.randrange(len(frame))
        frame[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
    elif how == "drop":
        frames.pop(i)
        return b"".join(frames)
    elif how == "swap" and len(frames) > 1:
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
        return b"".join(frames)
    else:
        frame = bytearray(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
    frames[i] = bytes(frame)
    return b"".join(frames)


def test_random_and_mutated_frames_for_a_bounded_time_leave_the_broker_serving(
        pulsar_broker: BrokerProcess) -> None:
    host, port = pulsar_broker.pulsar_url.removeprefix("pulsar://").rsplit(":", 1)
    rng = random.Random(int(os.environ.get("TIERSTREAM_FUZZ_SEED", "39")))
    deadline = time.monotonic() + float(os.environ.get("TIERSTREAM_FUZZ_SECONDS", scaled(5)))
    cases = 0
    while time.monotonic() < deadline or cases < 50:
        data = _mutated(rng)
        with socket.create_connection((host, int(port)), timeout=scaled(10)) as sock:
            with contextlib.suppress(OSError):  # the broker may close before all is written
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            try:  # the broker answers and closes once our side is done: never a hang
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        cases += 1
        assert pulsar_broker.proc is not None and pulsar_broker.proc.poll() is None, cases
    # what was stored came from well-formed SENDs only: each row decodes as sent
    for row in rows_of(pulsar_broker, TOPIC) if _exists(pulsar_broker) else []:
        assert row["key"] is None or row["key"].startswith("k"), row
    client = client_of(pulsar_broker)
    try:
        client.create_producer(TOPIC, producer_name="after").send(b"after", partition_key="z")
    finally:
        client.close()
    assert [r["value"] for r in rows_of(pulsar_broker, TOPIC) if r["key"] == "z"] == [b"after"]
    assert cases >= 50
    assert pulsar_broker.tracebacks == []


def _exists(broker: BrokerProcess) -> bool:
    from tierstream.client import Admin
    from tierstream.errors import NotFoundError

    with Admin(broker.url) as admin:
        try:
            admin.get_topic(TOPIC)
        except NotFoundError:
            return False
        return True
