"""One scale factor for every deadline the tests wait on.

A test waits on a condition, never on a time; but each wait has a deadline after which it
fails, and load (two CPU-bound loops beside the suite, a busy CI machine) stretches how long
a broker takes to start, recover or answer. Deadlines are therefore written as the time an
idle 2-core machine needs with a wide margin, and multiplied by ``TIERSTREAM_TEST_SCALE``
(default 2: two busy loops on 2 cores roughly halve the CPU a test gets). Raise it on slower
machines; never lower a literal to make a test faster — the condition ends the wait.
"""

from __future__ import annotations

import os

__all__ = ["SCALE", "scaled"]

SCALE = float(os.environ.get("TIERSTREAM_TEST_SCALE", "2"))


def scaled(seconds: float) -> float:
    """``seconds`` (what an idle machine needs, with margin) times the suite's scale."""
    return seconds * SCALE
