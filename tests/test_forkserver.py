"""The tests' fork server (``tests/forkserver.py``) starts commands as ``subprocess`` would:
each gets its own argv, environment, directory and streams, the real pid, and its exit
status, also when killed."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import forkserver
from .timing import scaled

CLI = [sys.executable, "-m", "tierstream"]


@pytest.fixture
def server() -> Iterator[forkserver.ForkServer]:
    server = forkserver.ForkServer()
    yield server
    server.close()


def test_a_command_gets_its_own_environment_directory_and_streams(server, tmp_path: Path
                                                                  ) -> None:
    proc = server.popen([*CLI, "topic", "list"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                        env={"PATH": "/usr/bin:/bin", "TIERSTREAM_BROKER": "grpc://127.0.0.1:1"})
    out, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 1 and out == ""
    assert "cannot reach the broker at grpc://127.0.0.1:1" in err  # from its own environment
    # an armed crash point names a point that does not exist: refused at the start, loudly
    proc = server.popen([*CLI, "topic", "list"], stderr=subprocess.PIPE, text=True,
                        env={"TIERSTREAM_CRASH_AT": "no.such-point"})
    _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 1 and "unknown point 'no.such-point'" in err


def test_a_killed_command_reports_the_signal_and_others_run_on(server, tmp_path: Path) -> None:
    broker = server.popen([*CLI, "broker", "start", "--data-dir", str(tmp_path / "d"),
                           "--port", "0", "--pulsar-port", "0", "--admin-port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert broker.stdout is not None
    assert "listening on" in broker.stdout.readline()
    with pytest.raises(subprocess.TimeoutExpired):
        broker.wait(scaled(0.2))
    broker.send_signal(signal.SIGKILL)
    assert broker.wait(scaled(30)) == -signal.SIGKILL
    done = server.popen([*CLI, "--help"], stdout=subprocess.DEVNULL)
    assert done.wait(scaled(30)) == 0
