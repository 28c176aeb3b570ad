"""A store spread over processes, as on several hosts: PostgreSQL metadata, network bookies
(``tierstream bookie serve --metadata ...``) and brokers with ``--network-bookies``. Each
process can be put in a network namespace of its own (``Hosts``), so that "a host" can lose
its network (``ip link set down``) while its processes keep running.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierstream.broker.process import BrokerProcess

from .ports import fixed_port
from .timing import scaled

__all__ = ["BookieProcess", "Hosts", "broker_args"]

ROOT = Path(__file__).resolve().parents[1]
_READY = re.compile(r"listening on (\S+)")


class BookieProcess:
    """A ``tierstream bookie serve --metadata URL`` child: a network bookie."""

    def __init__(self, data_dir: Path, metadata: str, *, host_label: str,
                 bind: str = "127.0.0.1", port: int = 0, netns: str | None = None,
                 fsync: bool = False, bookie_id: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir, self.metadata, self.host_label = data_dir, metadata, host_label
        self.env = env  # added to this process's environment
        self.bookie_id = bookie_id
        # a port of its own from the start: restarted, it binds the same one (ports.py)
        if port == 0 and netns is None:
            port = fixed_port(bind)
        self.bind, self.port, self.netns, self.fsync = bind, port, netns, fsync
        self.url: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.stderr_tail: deque[str] = deque(maxlen=100)

    def command(self, *extra: str) -> list[str]:
        cmd = [sys.executable, "-m", "tierstream", "bookie", "serve", "--data-dir",
               str(self.data_dir), "--host", self.bind, "--port", str(self.port),
               "--metadata", self.metadata, "--host-label", self.host_label,
               "--fsync" if self.fsync else "--no-fsync", *extra]
        if self.bookie_id is not None:
            cmd += ["--bookie-id", self.bookie_id]
        return cmd

    def start(self, *extra: str) -> BookieProcess:
        """Start it (``extra``: more ``bookie serve`` flags, e.g. ``--replace``)."""
        cmd = self.command(*extra)
        self.url = None
        if self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=None if self.env is None else {**os.environ,
                                                                         **self.env})
        ready = threading.Event()

        def read(stream: Any, sink: Any) -> None:
            for line in stream:
                sink(line)

        def out(line: str) -> None:
            m = _READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                ready.set()

        threading.Thread(target=read, args=(self.proc.stdout, out), daemon=True).start()
        threading.Thread(target=read, args=(self.proc.stderr, self.stderr_tail.append),
                         daemon=True).start()
        deadline = scaled(60)
        while not ready.wait(0.1):
            deadline -= 0.1
            if self.proc.poll() is not None or deadline <= 0:
                self.kill()
                raise RuntimeError(f"the bookie did not start: {''.join(self.stderr_tail)}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *extra: str) -> BookieProcess:
        """Start it again on the same port (the address registered stays right). A port
        given to the test (``ports.py``) is outside the ephemeral range; one the test chose
        itself may be held a moment by another process's outgoing connection ('Address
        already in use', a suite run once failed so): it is tried again meanwhile."""
        self.kill()
        deadline = time.monotonic() + scaled(30)
        while True:
            self.url = None
            try:
                return self.start(*extra)
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # pacing the attempts, not synchronisation

    def wipe(self) -> None:
        """SIGKILL, and its disk is lost: the directory is empty."""
        self.kill()
        shutil.rmtree(self.data_dir)
        self.data_dir.mkdir()


def broker_args(metadata: str, *extra: str) -> list[str]:
    """A broker of the store whose metadata is ``metadata``: network bookies, and a tier and
    an Iceberg catalog every broker of the store shares (one per metadata database, as
    segment ids are)."""
    import tempfile

    tier = Path(tempfile.gettempdir()) / "tierstream-shared-tiers" / metadata.rsplit("/", 1)[1]
    tier.parent.mkdir(exist_ok=True)  # the catalog's directory: a broker does not make it
    return ["--metadata", metadata, "--network-bookies", "--no-fsync",
            "--bookie-timeout", f"{scaled(3):g}s", "--tier-url", str(tier), "--tier-shared",
            "--catalog-uri", f"sqlite:///{tier}-catalog.db", *extra]


_SETS = itertools.count()


class Hosts:
    """Network namespaces standing in for hosts, on one bridge: host ``i`` is reached at
    ``10.78.0.<i+2>``, this (the root) namespace at ``10.78.0.1``. The bridge and its subnet
    are the machine's one: a set of hosts holds a lock on them from enter to exit, so the
    tests of two pytest workers that use hosts take turns rather than share (or delete) a
    bridge."""

    BRIDGE, PREFIX = "tsbr78", "10.78.0"

    def __init__(self, names: list[str]) -> None:
        self.names = names
        # a set of hosts of its own: the kernel frees a deleted namespace, and the veth pair
        # of its host, in the background, so the next set must not reuse their names
        self.tag = f"ts{os.getpid() % 10000}x{next(_SETS) % 100}"

    def address(self, name: str) -> str:
        return f"{self.PREFIX}.{self.names.index(name) + 2}"

    @property
    def gateway(self) -> str:
        return f"{self.PREFIX}.1"

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def _veth(self, name: str) -> str:
        return f"{self.tag}{self.names.index(name)}"

    def __enter__(self) -> Hosts:
        import fcntl
        import tempfile

        self._lock = open(os.path.join(tempfile.gettempdir(), "tierstream-test-hosts.lock"),
                          "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # released by exit, or by a killed run's end
        try:
            with contextlib.suppress(subprocess.CalledProcessError):  # left by a killed run
                _ip("link", "del", self.BRIDGE)
            _ip("link", "add", self.BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.BRIDGE)
            _ip("link", "set", self.BRIDGE, "up")
            for name in self.names:
                ns, veth = self.ns(name), self._veth(name)
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("link", "set", veth, "master", self.BRIDGE)
                _ip("link", "set", veth, "up")
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address(name)}/24", "dev",
                    f"{veth}p")
                _ip("netns", "exec", ns, "ip", "link", "set", f"{veth}p", "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self, name: str) -> None:
        """The host loses its network; its processes keep running."""
        _ip("netns", "exec", self.ns(name), "ip", "link", "set", f"{self._veth(name)}p", "down")

    def mend(self, name: str) -> None:
        _ip("netns", "exec", self.ns(name), "ip", "link", "set", f"{self._veth(name)}p", "up")

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", self._veth(name))  # the pair at once, not when freed
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", self.ns(name))
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.BRIDGE)
        self._lock.close()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def hosts_or_fail(names: list[str]) -> Iterator[Hosts]:
    """``Hosts(names)``, or the test fails with the one line saying why it cannot have them."""
    import pytest

    why = network_namespaces_unavailable()
    if why is not None:
        pytest.fail(f"this test needs network namespaces: {why}", pytrace=False)
    with Hosts(names) as hosts:
        yield hosts


def network_namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tsprobe{os.getpid() % 10000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"ip netns add is not permitted here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def stop(proc: subprocess.Popen[Any] | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


__all__ += ["BrokerProcess", "hosts_or_fail", "network_namespaces_unavailable", "stop"]
