"""How the tests start a command that they then stop with SIGINT."""

from __future__ import annotations

import signal

__all__ = ["sigint_ignored"]


def sigint_ignored() -> None:
    """``preexec_fn`` for a command the test will Ctrl-C: SIGINT starts out ignored, as a
    non-interactive shell starts background jobs (``make test &``, CI runners) and as one of
    the suite's xdist workers inherits it. Python then installs no KeyboardInterrupt handler
    of its own, so the command must take SIGINT itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
