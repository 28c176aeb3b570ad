"""Topic limits and deletion: no request can break the store, and deleting is crash-safe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.errors import NotFoundError, UnavailableError
from tierstream.util.faults import ENV

from .. import forkserver
from ..timing import scaled
from .helpers import read_all

TOPIC = "acme/web/huge"


def _cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "tierstream", *args], capture_output=True,
                          text=True, timeout=scaled(120),
                          env={**os.environ, "TIERSTREAM_BROKER": url})


def test_too_many_partitions_are_refused_before_anything_is_registered(broker) -> None:
    # Regression: 100,000 partitions were accepted, exhausted the broker's file descriptors and
    # left a topic that made the broker unstartable.
    proc = _cli("topic", "create", TOPIC, "--partitions", "100000", url=broker.url)
    assert proc.returncode == 2 and "at most 1024 per topic" in proc.stderr
    with Admin(broker.url) as admin:
        assert admin.list_topics() == []
        admin.create_topic("acme/web/fine", 2)  # the broker is fine


def test_a_store_with_many_partitions_runs_and_restarts_under_a_low_file_limit(
        data_dir: Path) -> None:
    args = ["--max-open-ledgers", "32", "--no-fsync"]
    broker = BrokerProcess(data_dir, args=args, open_files=256).start()
    try:
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 300)  # 600 files if every ledger held its two open
        with Producer(TOPIC, broker=broker.url, batch_size=10) as producer:
            producer.send_many({"value": f"v{i}".encode(), "key": f"k{i}"} for i in range(3000))
        assert broker.stop() == 0
        broker = BrokerProcess(data_dir, args=args, open_files=256).start()
        values = read_all(broker.url, TOPIC).column("value").to_pylist()
        assert sorted(values) == sorted(f"v{i}".encode() for i in range(3000))
    finally:
        broker.kill()


def _files(data_dir: Path, topic: str) -> list[Path]:
    tier = data_dir / "tier" / Path(*topic.split("/"))
    ledgers = list((data_dir / "bookies").rglob("*.log"))
    return [*ledgers, *tier.rglob("*.parquet")] if tier.exists() else ledgers


def _fill_and_offload(url: str) -> None:
    with Admin(url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i}"} for i in range(200))
    with Admin(url) as admin:
        admin.seal(TOPIC)
        assert admin.offload(TOPIC)


def test_delete_removes_a_topic_everywhere_and_its_name_can_be_reused(broker, data_dir
                                                                      ) -> None:
    _fill_and_offload(broker.url)
    assert any(p.suffix == ".parquet" for p in _files(data_dir, TOPIC))
    proc = _cli("topic", "delete", TOPIC, url=broker.url)
    assert proc.returncode == 2 and "add --yes" in proc.stderr  # no terminal: no prompt
    proc = _cli("topic", "delete", TOPIC, "--yes", url=broker.url)
    assert proc.returncode == 0 and "deleted acme/web/huge (2 partition(s))" in proc.stdout
    assert _files(data_dir, TOPIC) == []  # ledgers and tier files
    # and no empty folders of the topic (nor of its tenant, which had no other topic)
    assert not (data_dir / "tier" / "acme").exists()
    with Admin(broker.url) as admin:
        assert admin.list_topics() == []
        with pytest.raises(NotFoundError):
            admin.get_topic(TOPIC)
        with pytest.raises(NotFoundError):
            admin.delete_topic(TOPIC)
        admin.create_topic(TOPIC, 1)  # the name is free again, and the topic is empty
    assert read_all(broker.url, TOPIC).num_rows == 0
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("tierstream", uri=f"sqlite:///{data_dir / 'catalog.db'}")
    assert not catalog.table_exists(("acme", "web", "huge"))


@pytest.mark.parametrize("point", ["topic.delete-marked", "topic.data-deleted"])
def test_a_deletion_interrupted_by_a_crash_finishes_at_restart(start_broker, free_port,
                                                               data_dir, point) -> None:
    broker = start_broker(port=free_port, env={ENV: point})
    _fill_and_offload(broker.url)
    with Admin(broker.url) as admin, pytest.raises(UnavailableError):
        admin.delete_topic(TOPIC)
    restarted = start_broker(port=free_port)
    with Admin(restarted.url) as admin:
        assert admin.list_topics() == []
    assert _files(data_dir, TOPIC) == []


def test_topic_set_retention(broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    proc = _cli("topic", "set", TOPIC, "--retention", "30d", url=broker.url)
    assert proc.returncode == 0 and "retention: 30 days" in proc.stdout
    with Admin(broker.url) as admin:
        assert admin.get_topic(TOPIC).retention_ms == 30 * 86_400_000
    proc = _cli("topic", "set", TOPIC, "--retention", "none", url=broker.url)
    assert proc.returncode == 0 and "retention: none (every message is kept)" in proc.stdout
    bad = _cli("topic", "set", TOPIC, "--retention", "forever", url=broker.url)
    assert bad.returncode == 2 and "invalid --retention 'forever'" in bad.stderr
