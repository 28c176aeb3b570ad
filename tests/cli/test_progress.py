"""Progress bars of the long commands: on a terminal, gone with --quiet or when stderr is not
a terminal. The commands run as real processes, stderr on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from tierstream.broker.process import BrokerProcess

from ..timing import scaled
from .test_cli import run

TOPIC = "acme/web/progress"


def on_a_terminal(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """Run ``tierstream ARGS`` with stderr on a pseudo-terminal (stdout not a terminal, and
    not a pipe nobody reads while the terminal is read): its exit status and what it drew
    there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tierstream", *args], stdout=subprocess.DEVNULL,
                            stderr=slave, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120",
                                 **env})
    os.close(slave)
    drawn = b""
    while True:
        ready, _, _ = select.select([master], [], [], scaled(60))
        if not ready:
            proc.kill()
            raise AssertionError(f"no output for {scaled(60)}s: {drawn[-2000:]!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    proc.communicate(timeout=scaled(60))
    return proc.returncode, drawn.decode(errors="replace")


def test_long_commands_show_progress_on_a_terminal_only(broker: BrokerProcess,
                                                        tmp_path: Path) -> None:
    env = {"TIERSTREAM_BROKER": broker.url or "", "TIERSTREAM_HOME": str(broker.data_dir)}
    assert run("topic", "create", TOPIC, "--partitions", "2", env=env).returncode == 0
    code, drawn = on_a_terminal("produce", TOPIC, "--generate", "20000", env=env)
    assert code == 0 and "producing" in drawn and "20000/20000" in drawn, drawn[-1000:]
    code, drawn = on_a_terminal("produce", TOPIC, "--generate", "1000", "--quiet", env=env)
    assert code == 0 and "producing" not in drawn and "produced 1000" in drawn
    piped = run("produce", TOPIC, "--generate", "1000", env=env)  # stderr is a pipe
    assert piped.returncode == 0 and "producing" not in piped.stderr

    code, drawn = on_a_terminal("consume", TOPIC, "--to", "latest", env=env)
    assert code == 0 and "consuming (messages)" in drawn and "22000" in drawn
    assert '"topic"' not in drawn  # the rows went to stdout, not above the bar

    code, drawn = on_a_terminal("read", TOPIC, "--out", str(tmp_path / "a.parquet"), env=env)
    assert code == 0 and "reading" in drawn
    code, drawn = on_a_terminal("read", TOPIC, "--out", str(tmp_path / "b.parquet"), "-q",
                                env=env)
    assert code == 0 and "reading" not in drawn

    assert run("seal", TOPIC, env=env).returncode == 0
    code, drawn = on_a_terminal("offload", TOPIC, env=env)
    assert code == 0 and "offloading (bookie bytes)" in drawn, drawn[-1000:]
    code, drawn = on_a_terminal("offload", TOPIC, "--quiet", env=env)  # nothing left
    assert code == 0 and "offloading" not in drawn
