"""What the Pulsar wire tests share: a real pulsar-client Client on a broker, and the rows
tierstream's reader sees."""

from __future__ import annotations

import socket
import struct
from typing import Any

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import read
from tierstream.model.positions import Offset
from tierstream.pulsar_protocol import pulsar_api_pb2 as api

from ..ports import fixed_port
from ..timing import scaled


def free_port() -> int:
    """A loopback port for a broker's second listener (``ports.py``)."""
    return fixed_port()


def client_of(broker: BrokerProcess, **kwargs: Any) -> Any:
    kwargs.setdefault("operation_timeout_seconds", int(scaled(15)))
    return pulsar.Client(kwargs.pop("url", broker.pulsar_url),
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn), **kwargs)


def each_message(consumer: Any, stop: Any, handle: Any, timeout_ms: int = 100) -> None:
    """``handle(message)`` for each message ``consumer`` receives, until ``stop`` is set."""
    while not stop.is_set():
        try:
            msg = consumer.receive(timeout_millis=timeout_ms)
        except pulsar.Timeout:
            continue
        handle(msg)


def rows_of(broker: BrokerProcess, topic: str) -> list[dict[str, Any]]:
    return [r for b in read(topic, broker=broker.url, end=Offset.latest())
            for r in b.to_pylist()]


def own_properties(row: dict[str, Any]) -> dict[str, str]:
    """A row's properties without the ones the broker adds (``pulsar.*``, the schema's)."""
    return {k: v for k, v in row["properties"] or []
            if not k.startswith(("pulsar.", "tierstream."))}


def commands_until(sock: socket.socket, until: Any) -> list[api.BaseCommand]:
    """Commands read from ``sock`` until ``until(commands)`` holds."""
    got: list[api.BaseCommand] = []
    buffer = b""
    while not until(got):
        chunk = sock.recv(65536)
        assert chunk, f"the broker closed the connection after {got}"
        buffer += chunk
        while len(buffer) >= 4 and len(buffer) >= 4 + struct.unpack(">I", buffer[:4])[0]:
            size = struct.unpack(">I", buffer[:4])[0]
            body, buffer = buffer[4:4 + size], buffer[4 + size:]
            (cmd_size,) = struct.unpack(">I", body[:4])
            command = api.BaseCommand()
            command.ParseFromString(body[4:4 + cmd_size])
            got.append(command)
    return got
