"""What the Pulsar wire tests share: a real pulsar-client Client on a broker, and the rows
tierstream's reader sees."""

from __future__ import annotations

from typing import Any

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import read
from tierstream.splits.positions import Offset

from ..timing import scaled


def client_of(broker: BrokerProcess, **kwargs: Any) -> Any:
    kwargs.setdefault("operation_timeout_seconds", int(scaled(15)))
    return pulsar.Client(kwargs.pop("url", broker.pulsar_url),
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn), **kwargs)


def rows_of(broker: BrokerProcess, topic: str) -> list[dict[str, Any]]:
    return [r for b in read(topic, broker=broker.url, end=Offset.latest())
            for r in b.to_pylist()]


def own_properties(row: dict[str, Any]) -> dict[str, str]:
    """A row's properties without the ones the broker adds (``pulsar.*``, the schema's)."""
    return {k: v for k, v in row["properties"] or []
            if not k.startswith(("pulsar.", "tierstream."))}
