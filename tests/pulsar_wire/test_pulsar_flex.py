"""An independently written Pulsar client — pulsar-flex, pure JavaScript, no C++ core —
produces and consumes through the broker (``flex/roundtrip.js``). Optional: skipped where
Node.js or npm is missing or the npm registry cannot be reached."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..store.helpers import wait_for
from ..timing import scaled
from .helpers import rows_of

FLEX_VERSION = "1.1.1"
SCRIPT = Path(__file__).parent / "flex" / "roundtrip.js"


@pytest.fixture(scope="module")
def flex_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js and npm are needed for the pulsar-flex client")
    where = tmp_path_factory.mktemp("flex")
    try:
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
                        f"pulsar-flex@{FLEX_VERSION}"], cwd=where, check=True,
                       capture_output=True, timeout=scaled(120))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"npm could not install pulsar-flex: {exc}")
    return where / "node_modules"


def test_pulsar_flex_produces_and_its_key_shared_and_exclusive_consumers_get_everything(
        pulsar_broker: BrokerProcess, flex_modules: Path) -> None:
    topic, count = "public/default/flex", 40
    server = pulsar_broker.pulsar_url.removeprefix("pulsar://")
    done = subprocess.run(["node", str(SCRIPT), server, f"persistent://{topic}", str(count)],
                          capture_output=True, text=True, timeout=scaled(120),
                          env=dict(os.environ, NODE_PATH=str(flex_modules)))
    assert done.returncode == 0, done.stderr[-2000:]
    got: dict[str, list[str]] = defaultdict(list)
    for line in done.stdout.splitlines():
        message = json.loads(line)
        got[message["consumer"]].append(message["value"])
        assert message["properties"] == {"i": message["value"][1:]}
    expected = [f"m{i}" for i in range(count)]
    assert got == {"flex-key-shared": expected, "flex-exclusive": expected}  # in order, once
    assert [r["value"].decode() for r in rows_of(pulsar_broker, topic)] == expected
    with Admin(pulsar_broker.url) as admin:  # every ack taken ("unsubscribe" closes them)
        wait_for(lambda: [(r["subscription"], r["backlog"], r["consumers"])
                          for r in admin.subscriptions(topic)] == [
            ("flex-exclusive", 0, []), ("flex-key-shared", 0, [])], timeout=scaled(30),
            what="both pulsar-flex subscriptions to have a backlog of 0, their consumers gone")
