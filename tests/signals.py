"""How the tests start a command that they then stop with SIGINT."""

from __future__ import annotations

import sys

__all__ = ["tierstream_ignoring_sigint"]

#: ignores SIGINT, then becomes ``python -m tierstream ARGS`` (a disposition to ignore a
#: signal is kept across exec)
_IGNORING = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
             "os.execv(sys.executable, [sys.executable, '-m', 'tierstream', *sys.argv[1:]])")


def tierstream_ignoring_sigint(*args: str) -> list[str]:
    """The command line of ``tierstream ARGS`` for a test that will Ctrl-C it: SIGINT starts
    out ignored, as a non-interactive shell starts background jobs (``make test &``, CI
    runners) and as one of the suite's xdist workers inherits it. Python then installs no
    KeyboardInterrupt handler of its own, so the command must take SIGINT itself. (Not a
    ``preexec_fn``: that forks the test process, whose native libraries' at-fork handlers
    can hang the child before it execs; see tests/store/test_broker_process.py.)"""
    return [sys.executable, "-c", _IGNORING, *args]
