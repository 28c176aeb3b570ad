"""PostgreSQL that vanishes without a word: a lock session the server keeps after the broker
gave it up. (A broker whose host is cut off from it: ``metadata_silence.py``, run with the
other tests in network namespaces.)

Regression: a metadata statement sent into the silence waited for the kernel's
retransmissions (about 15 minutes) with the broker's lock held; the outage limit was never
applied and the broker neither went on nor stopped. Now every session takes its server for
gone after ``DEAD_PEER_S`` of silence (``metadata/postgres.py``), the broker takes its lock
back when the server answers again, and gives the database up at the outage limit.
"""

from __future__ import annotations

import os
from typing import Any

from tierstream.metadata.postgres import DEAD_PEER_S, PostgresBackend

from ..timing import scaled
from .helpers import wait_for


def test_a_lock_session_the_server_still_keeps_is_ended_and_the_lock_taken_back(
        postgres: Any) -> None:
    """The lock's session lost on this side while the server keeps it (it has not seen it
    end: a server without the dead-peer settings, a pooler in between): the broker ends its
    own former session and holds the lock again, instead of taking it for another broker's
    and giving the database up."""
    url = postgres.new_database()
    backend = PostgresBackend(url, takeover_after_s=None)
    try:
        lease = backend.lease
        assert lease is not None
        session = lease._holder
        former = session.info.backend_pid
        # this side loses the session without a word to the server: libpq's socket now
        # leads to /dev/null, the real one is kept open (no FIN, no terminate message)
        kept = os.dup(session.fileno())
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, session.fileno())
        os.close(null)
        try:
            wait_for(lambda: backend.lost.is_set() or (lease._holder is not None
                                                        and lease._holder is not session),
                     timeout=scaled(6 * DEAD_PEER_S), what="the heartbeat to take the lock back")
            assert not backend.lost.is_set(), backend.lost_reason
            pids = [r[0] for r in backend.read(
                "SELECT pid FROM pg_stat_activity WHERE pid = ?", (former,))]
            assert pids == []  # the former session was ended by the broker
            assert lease._holder.info.backend_pid != former
        finally:
            os.close(kept)
    finally:
        backend.close()
