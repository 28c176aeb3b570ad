"""A broker's hold on its PostgreSQL metadata database: one writer at a time, a standby that
takes over a silent one.

The serving broker holds a session **advisory lock** (:data:`LOCK_KEY`) for as long as it runs,
as the data directory's flock holds a SQLite store: a second broker is refused. On that lock's
session it writes a **heartbeat** every :data:`HEARTBEAT_S` (``meta.writer_heartbeat``, by the
server's clock). A **standby** (``--standby``) waits for the lock; when the holder's heartbeat
is older than its ``takeover_after_s`` (its host died, its process hangs), it ends the holder's
sessions and takes the lock — the old broker cannot write metadata again: every new session of
its backend first takes the lock back (:meth:`LeaderLease.check`), and finds it held.

A broker whose lock session is lost while nobody took over (the server unreachable for a
while: the session died on this side, ``postgres.DEAD_PEER_S``) takes the lock again on a new
session; if the server still keeps the old session and its lock (it has not noticed it gone),
that session is recognised as this broker's own (server pid and start time) and ended first.
The heartbeat applies the outage limit as statements do: a broker that cannot take its lock
back within it gives the database up.

The lock is taken in one place, :meth:`LeaderLease._take_lock`; ``postgres.py`` is the SQL
backend the lease belongs to.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Protocol

from tierstream.errors import ConflictError, UnavailableError
from tierstream.metadata.backend import first_line
from tierstream.util.faults import fault_point
from tierstream.util.threads import Worker

__all__ = ["BROKER_APPLICATION", "HEARTBEAT_S", "LOCK_KEY", "STANDING_BY", "Database",
           "LeaderLease"]

log = logging.getLogger(__name__)

#: the advisory lock a broker holds its metadata database with
LOCK_KEY = 0x7469_6572_7374  # "tierst"
#: the application name of a broker's sessions (a standby taking over ends them)
BROKER_APPLICATION = "tierstream-broker"
#: how often a broker says it is alive, on its lock's session
HEARTBEAT_S = 1.0
#: what a standby logs once it waits for the broker holding the store (``broker start
#: --detach`` returns when it reads this)
STANDING_BY = "is held by another broker; this one takes over"
#: how long a stopping broker waits for the server to free its lock
UNLOCK_WAIT_S = 5.0


class Database(Protocol):
    """What the lease needs of its backend (``postgres.py``): sessions, and a way to give
    the database up."""

    name: str  # the URL without its password
    outage_limit_s: float
    lost: threading.Event
    lost_reason: str

    def open_session(self, application: str = ...) -> Any: ...

    def close_session(self) -> None: ...

    def session_pids(self) -> list[int]: ...

    def lose(self, reason: str) -> None: ...


class LeaderLease:
    """The advisory lock of ``backend``'s database, its session and its heartbeat thread."""

    def __init__(self, backend: Database, *, takeover_after_s: float | None,
                 on_standby: Callable[[], None] | None = None) -> None:
        self._backend = backend
        self.takeover_after_s = takeover_after_s
        self._on_standby = on_standby  # called once a standby starts waiting
        self._holder: Any = None  # the session holding the lock
        self._lock = threading.RLock()  # the holder session; _take_lock runs under it too
        self._reached_at: float | None = None  # a standby: since when it reaches the server
        self._heart: Worker | None = None
        #: (server pid, session start) of the session that took the lock last: a session
        #: the server still keeps after this side gave it up is ended, not taken for a rival
        self._held_by: tuple[int, Any] | None = None

    def take(self) -> None:
        """Take the lock and start the heartbeat. Held by another broker: refused
        (ConflictError), or for a standby waited for; a holder whose heartbeat stopped for
        ``takeover_after_s`` has its sessions ended and the lock is taken.

        A standby rides out the server's restarts and outages as the serving broker does:
        each try opens a new session, an unreachable server is waited for up to the outage
        limit, and a takeover it interrupted is tried again from the start. While the
        holder's heartbeat is fresh the standby leaves a free lock alone (a server restart
        frees it): the serving broker takes it back, rather than losing the store."""
        import psycopg

        name, limit, standby = self._backend.name, self._backend.outage_limit_s, \
            self.takeover_after_s
        told = False
        unreachable: float | None = None  # since when the server could not be reached
        while True:
            try:
                if self._try():
                    if unreachable is not None:
                        log.warning("the metadata store %s is reachable again after %.1f s",
                                    name, time.monotonic() - unreachable)
                    self._heart = Worker("metadata-heartbeat", self._beat,
                                         on_error=self._heartbeat_failed)
                    self._heart.start()
                    return
                if unreachable is not None:
                    log.warning("the metadata store %s is reachable again after %.1f s; "
                                "standing by", name, time.monotonic() - unreachable)
                    unreachable = None
            except (psycopg.OperationalError, UnavailableError) as exc:
                self._reached_at = None
                if standby is None:  # a broker starting: it says so and stops
                    if isinstance(exc, UnavailableError):
                        raise
                    raise UnavailableError(f"cannot use the metadata store {name}: "
                                           f"{first_line(exc)}") from None
                now = time.monotonic()
                if unreachable is None:
                    unreachable = now
                    log.warning("standing by: the metadata store %s is unreachable (%s); "
                                "waiting for it for up to %.0f s", name, first_line(exc), limit)
                elif now - unreachable >= limit:
                    raise UnavailableError(
                        f"the metadata store {name} was unreachable for "
                        f"{now - unreachable:.0f} s while this broker stood by: "
                        f"{first_line(exc)}") from None
            if not told and standby is not None:
                if self._on_standby is not None:
                    self._on_standby()
                log.info("standing by: the metadata store %s %s once that one is silent "
                         "for %g s", name, STANDING_BY, standby)
                told = True
            time.sleep(min(1.0, (standby or 4.0) / 4))

    def _try(self) -> bool:
        """One try at the lock, on a session of its own; True once held. A standby ends the
        sessions of a holder silent for ``takeover_after_s`` — counted from when this one
        last reached the server, as nobody can write a heartbeat while it is away — and the
        next try takes the lock."""
        standby = self.takeover_after_s
        holder = self._backend.open_session(BROKER_APPLICATION)
        try:
            silent = None  # a broker that is not a standby takes a free lock at once
            if standby is not None:
                if self._reached_at is None:
                    self._reached_at = time.monotonic()
                silent = _silent_for(holder)
                if silent is not None:
                    silent = min(silent, time.monotonic() - self._reached_at)
                    if silent < standby:
                        return False  # the holder is alive (a lock a restart freed is its)
            if self._take_lock(holder):
                holder = None
                self.heartbeat()
                return True
            held = self._backend.name
            if standby is None:
                row = _lock_holder(holder)
                self._backend.close_session()
                since = f" (connected {row[1]:%Y-%m-%d %H:%M:%S})" if row else ""
                raise ConflictError(f"the metadata store {held} is held by another "
                                    f"running broker{since}: stop it first, give this one "
                                    "its own database, or start it with --standby to take "
                                    "over when that broker stops")
            if silent is not None:  # silent for takeover_after_s at least
                log.warning("taking over the metadata store %s: the broker holding it was "
                            "last heard from %.1f s ago", held, silent)
                self._end_other_brokers(holder)
            return False
        finally:
            if holder is not None:
                holder.close()

    def _take_lock(self, session: Any) -> bool:
        """The one place the lock is taken: on ``session``, which holds it from then on."""
        got, start = session.execute(
            "SELECT pg_try_advisory_lock(%s), (SELECT backend_start FROM pg_stat_activity "
            "WHERE pid = pg_backend_pid())", (LOCK_KEY,)).fetchone()
        if got:
            with self._lock:
                self._holder = session
                self._held_by = (session.info.backend_pid, start)
        return bool(got)

    def _end_former_session(self, session: Any) -> bool:
        """True once the lock, held by this broker's own former session (which the server
        has not seen end), is taken on ``session`` after ending that one."""
        former = self._held_by
        holder = _lock_holder(session)
        if former is None or holder != former:
            return False
        log.warning("the metadata store %s still keeps this broker's former session (server "
                    "pid %d), which holds its lock: ending it", self._backend.name, former[0])
        session.execute("SELECT pg_terminate_backend(%s)", (former[0],))
        deadline = time.monotonic() + UNLOCK_WAIT_S  # the server frees the lock as it ends
        while not self._take_lock(session):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _end_other_brokers(self, session: Any) -> None:
        """End every other broker's session on this database (the lock holder's too), from
        ``session`` (a new one: the standby's first connection may not outlive a server
        restart); this process's own sessions are spared."""
        mine = [session.info.backend_pid, *self._backend.session_pids()]
        session.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
            "%s AND datname = current_database() AND pid <> ALL(%s)",
            (BROKER_APPLICATION, mine))

    def heartbeat(self) -> None:
        """Say on the lock's session that this broker is alive (a standby takes over when
        it stops); nothing before the tables exist."""
        import psycopg

        with self._lock:
            holder = self._holder
            if holder is None:
                return
            with suppress(psycopg.errors.UndefinedTable):
                holder.execute(
                    "INSERT INTO meta (key, value) VALUES ('writer_heartbeat', "
                    "(extract(epoch from clock_timestamp()) * 1000)::bigint::text) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value")

    def _beat(self) -> None:
        """Every HEARTBEAT_S: the heartbeat, on the lock's session; that session lost, the
        lock taken again first. Unable to for the outage limit: the database is given up."""
        import psycopg

        assert self._heart is not None
        backend = self._backend
        unreachable: float | None = None  # since when the lock could not be kept
        while not self._heart.stopping.wait(HEARTBEAT_S):
            fault_point("metadata.heartbeat")
            try:
                if self._holder is None:  # lost at the last beat, or by a statement's check
                    self.check()
                try:
                    self.heartbeat()
                except psycopg.OperationalError:
                    self.check()  # the lock's session is gone: the lock taken again
                    self.heartbeat()
                if unreachable is not None:
                    log.warning("the metadata store %s is reachable again after %.1f s; "
                                "this broker holds its lock", backend.name,
                                time.monotonic() - unreachable)
                    unreachable = None
            except (psycopg.OperationalError, UnavailableError) as exc:
                if backend.lost.is_set():
                    return  # taken over, or given up on: the broker stops (broker/run.py)
                now = time.monotonic()
                if unreachable is None:
                    unreachable = now
                    log.warning("the metadata store %s is unreachable (%s): this broker "
                                "takes its lock again when it answers, for up to %.0f s",
                                backend.name, first_line(exc), backend.outage_limit_s)
                elif now - unreachable >= backend.outage_limit_s:
                    backend.lose(f"the metadata store {backend.name} was unreachable for "
                                 f"{now - unreachable:.0f} s: {first_line(exc)}")
                    return

    def _heartbeat_failed(self, exc: BaseException) -> None:
        """The heartbeat thread died of an error nobody foresaw: a standby would take the
        store over without this broker knowing, so it stops writing now (``broker/run.py``
        stops it with one line) rather than be cut off mid-write."""
        self._backend.lose(f"the heartbeat of the metadata store {self._backend.name} "
                           f"failed: {exc!r}")

    def check(self) -> None:
        """Before a writer uses a new session: the lock's session must still be alive, or the
        lock taken again. Another broker holding it took the database over: lost."""
        import psycopg

        backend = self._backend
        with self._lock:  # one session at a time tries: a second would find the first's lock
            if backend.lost.is_set():
                raise UnavailableError(backend.lost_reason)
            holder = self._holder
            if holder is not None:
                try:
                    holder.execute("SELECT 1")
                    return
                except psycopg.OperationalError:
                    holder.close()
                    self._holder = None
            session = backend.open_session(BROKER_APPLICATION)
            try:
                if self._take_lock(session) or self._end_former_session(session):
                    return
            except psycopg.OperationalError:
                session.close()
                raise
            session.close()
            backend.lose(f"another broker took the metadata store {backend.name} over while "
                         "this one was not heard from")
            raise UnavailableError(backend.lost_reason)

    def release(self) -> None:
        """Stop the heartbeat (joined), free the lock and end its session. The lock is freed
        on its session first: the server ends a closed session in its own time, and a
        broker started right after this one stopped (a restart) found it still held."""
        if self._heart is not None:
            self._heart.stop(timeout=10 * HEARTBEAT_S)
        with self._lock:
            if self._holder is not None and not self._holder.closed:
                _unlock(self._holder, self._backend.name, UNLOCK_WAIT_S)
                self._holder.close()
            self._holder = None


def _unlock(session: Any, name: str, wait_s: float) -> None:
    """``pg_advisory_unlock`` on ``session``, waiting up to ``wait_s`` for its answer: a server
    that cannot be reached (a broker stopping during an outage) frees the lock once it notices
    the session gone, and the broker does not hang on it."""
    import psycopg

    conn = session.pgconn
    deadline = time.monotonic() + wait_s
    try:
        conn.send_query(b"SELECT pg_advisory_unlock(%d)" % LOCK_KEY)
        while True:
            conn.consume_input()
            if not conn.is_busy():
                while conn.get_result() is not None:
                    pass
                return
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([conn.socket], [], [], left)[0]:
                log.warning("the metadata store %s did not answer the release of its lock "
                            "in %g s; it frees it once it sees the session end", name, wait_s)
                return
    except psycopg.Error:
        return  # the session is gone: so is its lock


def _lock_holder(session: Any) -> tuple[int, Any] | None:
    """(server pid, session start) of the session holding the lock, or None when it is
    free."""
    row = session.execute(
        "SELECT a.pid, a.backend_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = "
        "l.pid WHERE l.locktype = 'advisory' AND l.objid = %s AND l.granted",
        (LOCK_KEY & 0xFFFF_FFFF,)).fetchone()
    return None if row is None else (row[0], row[1])


def _silent_for(conn: Any) -> float | None:
    """Seconds since the holder's last heartbeat, by the server's clock (None: it has none
    yet)."""
    import psycopg

    try:
        row = conn.execute(
            "SELECT extract(epoch from clock_timestamp()) * 1000 - value::bigint FROM meta "
            "WHERE key = 'writer_heartbeat'").fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    return None if row is None else float(row[0]) / 1000
