"""A broker process with its Pulsar listener on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierstream.broker.process import BrokerProcess


@pytest.fixture
def pulsar_broker(start_broker, free_port) -> BrokerProcess:
    broker: BrokerProcess = start_broker("--pulsar-port", str(free_port))
    assert broker.pulsar_url == f"pulsar://127.0.0.1:{free_port}"
    return broker


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker with its Pulsar listener for a whole test module, whose tests each use
    topics of their own (small cases that a broker start each would dwarf)."""
    from ..ports import fixed_port

    broker = BrokerProcess(tmp_path_factory.mktemp("module-broker"),
                           args=["--pulsar-port", str(fixed_port())]).start()
    yield broker
    broker.kill()
