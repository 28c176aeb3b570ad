"""A broker process with its Pulsar listener on a free port."""

from __future__ import annotations

import pytest

from tierstream.broker.process import BrokerProcess


@pytest.fixture
def pulsar_broker(start_broker, free_port) -> BrokerProcess:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    assert broker.pulsar_url == f"pulsar://127.0.0.1:{free_port}"
    return broker
