"""Run a broker as a separate process: for the demo, the tests and the benchmarks.

The child prints ``tierstream broker listening on URL`` once it accepts calls; :meth:`start`
waits for that line (with a deadline), so callers never sleep to synchronise.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from tierstream.errors import UnavailableError
from tierstream.util.threads import Worker

__all__ = ["FATAL_SIGNAL", "BrokerProcess"]

_READY = re.compile(r"listening on (\S+)")
_PULSAR = re.compile(r"pulsar clients: (\S+)")
_ADMIN = re.compile(r"pulsar admin: (\S+)")
#: how faulthandler's report of a fatal signal begins
FATAL_SIGNAL = "Fatal Python error"


class BrokerProcess:
    """A ``tierstream broker start`` child process on loopback (``port=0``: any free port)."""

    #: what starts the child (the tests put a fork server's equivalent in its place)
    popen: Callable[..., Any] = subprocess.Popen

    def __init__(self, data_dir: str | Path, *, port: int = 0, host: str = "127.0.0.1",
                 args: list[str] | None = None, env: dict[str, str] | None = None,
                 open_files: int | None = None, prefix: list[str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        #: a command the broker runs under (``ip netns exec NS`` in the tests: another host)
        self.prefix = list(prefix or [])
        self.port = port
        self.host = host
        self.args = list(args or [])
        self.env = env
        self.open_files = open_files  # a hard limit of open files for the child (tests)
        self.url: str | None = None
        self.pulsar_url: str | None = None  # pulsar://host:port, with --pulsar-port
        self.admin_url: str | None = None  # http(s)://host:port, Pulsar's admin REST subset
        self.proc: subprocess.Popen[str] | None = None
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self.stdout_lines: list[str] = []  # what the broker printed (its start banner)
        self.tracebacks: list[str] = []  # the line after each traceback the broker printed
        #: the first lines of a fatal-signal report (faulthandler: the CLI turns it on), with
        #: the stack of the thread that crashed: kept whole, the tail may scroll past them
        self.fatal: list[str] = []
        self._readers: list[Worker] = []  # of its stdout and stderr, once started

    def __repr__(self) -> str:
        return f"BrokerProcess(data_dir={str(self.data_dir)!r}, url={self.url!r})"

    def start(self, timeout: float = 60.0) -> Self:
        # the Pulsar listeners (--pulsar-port, --admin-port) only where asked for: a fixed
        # default port would collide between brokers started side by side
        pulsar = [] if any(a.startswith("--pulsar-port") for a in self.args) \
            else ["--pulsar-port", "0"]
        if not any(a.startswith("--admin-port") for a in self.args):
            pulsar += ["--admin-port", "0"]
        if any(a.startswith("--tls-cert") for a in self.args) and not any(
                a.startswith("--pulsar-tls-port") for a in self.args):
            pulsar += ["--pulsar-tls-port", "0"]
        cmd = [*self.prefix, sys.executable, "-m", "tierstream", "broker", "start", "--data-dir",
               str(self.data_dir), "--host", self.host, "--port", str(self.port), *pulsar,
               *self.args]
        env = {**os.environ, **(self.env or {})}
        if self.open_files is not None:  # set by util-linux's prlimit, which then execs it
            cmd = ["prlimit", f"--nofile={self.open_files}:{self.open_files}", *cmd]
        # No preexec_fn: with one, the child is made by fork() and runs the at-fork handlers
        # of the libraries loaded here (gRPC's, the Pulsar client's), which can hang it
        # before it execs; without, it is spawned and runs none
        self.proc = type(self).popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        ready = threading.Event()
        self.stdout_lines = []

        def read_stdout() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                p = _PULSAR.search(line)
                if p:
                    self.pulsar_url = p.group(1)
                a = _ADMIN.search(line)
                if a:
                    self.admin_url = a.group(1)
                m = _READY.search(line)
                if m and not ready.is_set():
                    self.url = m.group(1)
                    ready.set()

        def read_stderr() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            in_traceback = False
            for line in self.proc.stderr:
                self.stderr_tail.append(line)
                if line.startswith(FATAL_SIGNAL) or 0 < len(self.fatal) < 40:
                    self.fatal.append(line)
                if line.startswith("Traceback"):
                    in_traceback = True
                elif in_traceback and not line.startswith(" "):  # the exception's line
                    self.tracebacks.append(line.strip())
                    in_traceback = False

        # they end with the process's output: stop() and kill() join them, so what it said
        # last is in stderr_tail when they return
        self._readers = [Worker("tierstream-broker-stdout", read_stdout).start(),
                         Worker("tierstream-broker-stderr", read_stderr).start()]
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise UnavailableError(
                    f"broker did not start (exit {self.proc.returncode}): "
                    f"{''.join(self.stderr_tail)[-2000:]}")
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for a clean exit; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise UnavailableError(f"broker did not stop within {timeout}s of SIGTERM") from None
        finally:
            self._join_readers()
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the store can tell."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._join_readers()

    def _join_readers(self) -> None:
        for reader in self._readers:
            reader.join(timeout=5)  # a child it started may hold the pipe: not for good

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(UnavailableError):
                self.stop()
