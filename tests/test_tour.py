"""The README's CLI tour, run as written (in order) against a broker on a free port.

Each command of the tour's bash block runs through bash, so pipes work as shown; the broker
the tour starts with ``--detach`` is this test's broker (on a free port: ``broker start
--detach`` and ``broker stop`` themselves are tested in ``tests/cli/test_cli.py``), and
``broker stop`` is its stop. Outputs that the
tour promises are checked, including that backfill-then-tail is exactly the log.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tierstream.broker.process import BrokerProcess

from .guide import README
from .timing import scaled


def tour_commands() -> list[str]:
    tour = README.read_text()[README.read_text().index("## A five-minute tour of the CLI"):]
    block = re.search(r"```bash\n(.*?)```", tour, re.S)
    assert block
    commands, current = [], ""
    for line in block.group(1).splitlines():
        code = re.sub(r"\s+#.*$", "", line).rstrip()
        if code.endswith("\\"):
            current += code[:-1] + " "
            continue
        current += code.strip()
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


@pytest.mark.spark
@pytest.mark.slow
def test_the_readme_tour_runs_as_written(data_dir: Path, tmp_path: Path) -> None:
    commands = tour_commands()
    assert commands[1] == "tierstream broker start --detach"
    assert commands[-1] == "tierstream broker stop"
    broker = BrokerProcess(data_dir).start()
    env = {**os.environ, "TIERSTREAM_BROKER": broker.url or "",
           "TIERSTREAM_HOME": str(data_dir), "TIERSTREAM_SPARK_MASTER": "local[2]",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    outputs: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        for command in commands[2:-1]:
            if "--follow" in command:  # the tail runs until stopped: it must still be running
                with pytest.raises(subprocess.TimeoutExpired):
                    subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                                   capture_output=True, text=True, timeout=scaled(5))
                continue
            proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=scaled(300))
            assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
            outputs[command] = proc
        assert broker.stop() == 0  # broker stop: a clean stop
    finally:
        broker.kill()

    def out(prefix: str) -> str:
        (found,) = [p.stdout + p.stderr for c, p in outputs.items() if c.startswith(prefix)]
        return found

    assert len(out("tierstream consume acme/web/clicks --from 2026-11-03").splitlines()) == 600
    assert len(out("tierstream consume acme/web/clicks --key-range").splitlines()) == 5
    assert "wrote 14,400 rows" in out("tierstream read")
    backfill = out("tierstream backfill")
    assert "100,000 rows" in backfill and "end cut:" in backfill
    assert (tmp_path / "week.cut").exists()
    # the tail from the backfill's cut holds exactly what came after it: the one echo line
    live = [pq.read_table(f) for f in (tmp_path / "live").glob("*.parquet")]
    assert sum(t.num_rows for t in live) == 1
    assert [v for t in live for v in t.column("value").to_pylist()] == [b"hello"]
    assert "deleted acme/web/clicks" in out("tierstream topic delete")
