"""Ports for listeners a test binds by number: a process restarted on its old address, or a
port chosen before the process that binds it starts.

A port from the kernel's ephemeral range (``ip_local_port_range``, 32768-60999 here) that is
free a moment ago is not free for long: every outgoing connection and every listener bound to
port 0, in any pytest worker, may take it meanwhile. A suite run on CI once lost so a killed
bookie's port to another test's broker, whose endpoint then answered the bookie's address. So
these ports come from below the ephemeral range, from a block of its own for each pytest
worker, and are never handed out twice in one session."""

from __future__ import annotations

import os
import random
import socket

__all__ = ["fixed_port"]

_LOW, _BLOCK, _WORKERS = 20_000, 1_500, 8
_given: set[int] = set()


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start = _LOW + (index % _WORKERS) * _BLOCK
    return range(start, start + _BLOCK)


def fixed_port(host: str = "127.0.0.1") -> int:
    """A port of this worker's block that binds on ``host`` now and was not given before."""
    block = _block()
    for _ in range(len(block)):
        port = random.choice(block)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port left in {block}")
