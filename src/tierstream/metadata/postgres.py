"""The metadata store on PostgreSQL (``broker start --metadata postgresql://user@host/db``,
``TIERSTREAM_METADATA``), through psycopg 3.

**Transactions.** Every metadata transaction that is one SQLite transaction is one PostgreSQL
transaction (``Backend.transaction``), at READ COMMITTED. That is enough because two writers
never interleave: a broker holds the database with a session advisory lock for as long as it
runs (a second broker is refused, as the data directory's flock refuses one for SQLite), and
its own statements go through one connection under one lock, as with SQLite; readers (the
CLI, planners) only read, and every write they could see is a committed whole.

**Failures.** While PostgreSQL cannot be reached, every metadata statement waits, trying
again with backoff (0.2 s doubling to 5 s): the acks that need a metadata write (cursor
commits, segment rolls) stop, everything else goes on, and all resume when the server is
back. After :func:`outage_limit_s` (60 s; ``TIERSTREAM_METADATA_OUTAGE_S``) the backend gives
up: the statement raises ``UnavailableError`` and :attr:`PostgresBackend.lost` is set, which
stops the broker cleanly with one line (``broker/run.py``). A connection that breaks in the
middle of a transaction fails that transaction (``UnavailableError``): nothing that depends on
it is acknowledged.

Statements are written once for both engines (``backend.py``); here ``?`` and ``:name``
become psycopg's ``%s`` and ``%(name)s``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from typing import Any

from tierstream.errors import ConfigError, ConflictError, UnavailableError
from tierstream.metadata.backend import Args, Cursor, Tx, UniqueViolation

__all__ = ["STANDING_BY", "PostgresBackend", "outage_limit_s", "safe_url"]

log = logging.getLogger(__name__)
#: what a standby logs once it waits for the broker holding the store (``broker start
#: --detach`` returns when it reads this)
STANDING_BY = "is held by another broker; this one takes over"

#: the first pause before trying an unreachable server again, and the longest
FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 5.0


def outage_limit_s() -> float:
    """How long statements wait for an unreachable server before the backend gives up."""
    raw = os.environ.get("TIERSTREAM_METADATA_OUTAGE_S", "60")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"invalid TIERSTREAM_METADATA_OUTAGE_S {raw!r}: expected seconds") \
            from None
    if value <= 0:
        raise ConfigError(f"invalid TIERSTREAM_METADATA_OUTAGE_S {raw!r}: expected seconds > 0")
    return value
#: the advisory lock a broker holds its metadata database with
LOCK_KEY = 0x7469_6572_7374  # "tierst"
#: the application name of a broker's sessions (a standby taking over ends them)
BROKER_APPLICATION = "tierstream-broker"
#: how often a broker says it is alive, on its lock's session
HEARTBEAT_S = 1.0

_PLACEHOLDER = re.compile(r"'[^']*'|::|\?|:(\w+)|%")


@lru_cache(maxsize=512)
def _translate(sql: str) -> str:
    """``?`` -> ``%s``, ``:name`` -> ``%(name)s``, ``%`` -> ``%%``; string literals and
    ``::`` casts kept as they are."""
    def one(m: re.Match[str]) -> str:
        text = m.group(0)
        if text.startswith("'") or text == "::":
            return text.replace("%", "%%")
        if text == "?":
            return "%s"
        if text == "%":
            return "%%"
        return f"%({m.group(1)})s"

    return _PLACEHOLDER.sub(one, sql)


def safe_url(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class _PgTx:
    def __init__(self, cur: Any) -> None:
        self._cur = cur

    def execute(self, sql: str, args: Args = ()) -> Cursor:
        import psycopg

        try:
            self._cur.execute(_translate(sql), args or None)
        except psycopg.errors.UniqueViolation as exc:
            raise UniqueViolation(str(exc).splitlines()[0]) from None
        cursor: Cursor = self._cur
        return cursor

    def executemany(self, sql: str, rows: Sequence[Args]) -> None:
        import psycopg

        if not rows:
            return
        try:
            self._cur.executemany(_translate(sql), rows)
        except psycopg.errors.UniqueViolation as exc:
            raise UniqueViolation(str(exc).splitlines()[0]) from None


class PostgresBackend:
    """One PostgreSQL database. A writer (``read_only=False``: the broker) holds it with an
    advisory lock until :meth:`close`."""

    dialect = "postgresql"

    def __init__(self, url: str, *, read_only: bool = False,
                 takeover_after_s: float | None = None, hold: bool = True,
                 on_standby: Callable[[], None] | None = None) -> None:
        self.url = url
        self._on_standby = on_standby  # called once a standby starts waiting
        self.hold = hold
        self.name = safe_url(url)
        self.read_only = read_only
        self._lock = threading.RLock()
        self._conn: Any = None
        self._holder: Any = None  # the session holding the advisory lock
        self._holder_lock = threading.Lock()
        self._reached_at: float | None = None  # a standby: since when it reaches the server
        self.outage_limit_s = outage_limit_s()
        #: set once the server stayed unreachable past the limit, or another broker took the
        #: database over, with the reason
        self.lost = threading.Event()
        self.lost_reason = ""
        self._stop = threading.Event()
        self._connect()
        if not read_only and hold:  # hold=False: a bookie registering itself
            self._hold(takeover_after_s)
            threading.Thread(target=self._beat, name="metadata-heartbeat", daemon=True).start()

    # -- connections --------------------------------------------------------------------------

    def _open(self, application: str = "tierstream") -> Any:
        try:
            import psycopg
        except ImportError:  # pragma: no cover - a dependency of tierstream
            raise ConfigError("PostgreSQL metadata needs psycopg: pip install "
                              "'psycopg[binary]'") from None
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=10,
                                   application_name=application)
        except psycopg.ProgrammingError as exc:  # a malformed URL
            raise ConfigError(f"invalid metadata URL {self.name!r}: {_first_line(exc)}") \
                from None
        except psycopg.OperationalError as exc:
            raise UnavailableError(f"cannot connect to the metadata store {self.name}: "
                                   f"{_first_line(exc)}") from None

    def _connect(self) -> None:
        self._conn = self._open(BROKER_APPLICATION if self.hold and not self.read_only
                                else "tierstream")
        if self.read_only:
            self._conn.read_only = True

    def _hold(self, takeover_after_s: float | None) -> None:
        """Take the database's advisory lock. Held by another broker: refused (ConflictError),
        or with ``takeover_after_s`` (a standby) waited for; a holder whose heartbeat stopped
        for that long (its host died, or its process hangs) has its sessions ended, and the
        lock is taken: the old broker cannot write metadata any more (its sessions are gone,
        and it cannot take the lock back: :meth:`_check_holder`).

        A standby rides out the server's restarts and outages as the serving broker does:
        each try opens a new session, an unreachable server is waited for up to the outage
        limit, and a takeover it interrupted is tried again from the start. While the
        holder's heartbeat is fresh the standby leaves a free lock alone (a server restart
        frees it): the serving broker takes it back, rather than losing the store."""
        import psycopg

        told = False
        unreachable: float | None = None  # since when the server could not be reached
        while True:
            try:
                if self._try_hold(takeover_after_s):
                    if unreachable is not None:
                        log.warning("the metadata store %s is reachable again after %.1f s",
                                    self.name, time.monotonic() - unreachable)
                    return
                if unreachable is not None:
                    log.warning("the metadata store %s is reachable again after %.1f s; "
                                "standing by", self.name, time.monotonic() - unreachable)
                    unreachable = None
            except (psycopg.OperationalError, UnavailableError) as exc:
                self._reached_at = None
                if takeover_after_s is None:  # a broker starting: it says so and stops
                    if isinstance(exc, UnavailableError):
                        raise
                    raise UnavailableError(f"cannot use the metadata store {self.name}: "
                                           f"{_first_line(exc)}") from None
                now = time.monotonic()
                if unreachable is None:
                    unreachable = now
                    log.warning("standing by: the metadata store %s is unreachable (%s); "
                                "waiting for it for up to %.0f s", self.name,
                                _first_line(exc), self.outage_limit_s)
                elif now - unreachable >= self.outage_limit_s:
                    raise UnavailableError(
                        f"the metadata store {self.name} was unreachable for "
                        f"{now - unreachable:.0f} s while this broker stood by: "
                        f"{_first_line(exc)}") from None
            if not told and takeover_after_s is not None:
                if self._on_standby is not None:
                    self._on_standby()
                log.info("standing by: the metadata store %s %s once that one is silent "
                         "for %g s", self.name, STANDING_BY, takeover_after_s)
                told = True
            time.sleep(min(1.0, (takeover_after_s or 4.0) / 4))

    def _try_hold(self, takeover_after_s: float | None) -> bool:
        """One try at the lock, on a session of its own; True once held. A standby ends the
        sessions of a holder silent for ``takeover_after_s`` — counted from when this one
        last reached the server, as nobody can write a heartbeat while it is away — and the
        next try takes the lock."""
        holder = self._open(BROKER_APPLICATION)
        try:
            silent = None  # a broker that is not a standby takes a free lock at once
            if takeover_after_s is not None:
                if self._reached_at is None:
                    self._reached_at = time.monotonic()
                silent = self._silent_for(holder)
                if silent is not None:
                    silent = min(silent, time.monotonic() - self._reached_at)
                    if silent < takeover_after_s:
                        return False  # the holder is alive (a lock a restart freed is its)
            (got,) = holder.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()
            if got:
                with self._holder_lock:
                    self._holder, holder = holder, None
                self._heartbeat()
                return True
            if takeover_after_s is None:
                row = holder.execute(
                    "SELECT a.application_name, a.client_addr, a.backend_start FROM pg_locks l "
                    "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
                    "AND l.objid = %s AND l.granted", (LOCK_KEY & 0xFFFF_FFFF,)).fetchone()
                self._conn.close()
                since = f" (connected {row[2]:%Y-%m-%d %H:%M:%S})" if row else ""
                raise ConflictError(f"the metadata store {self.name} is held by another "
                                    f"running broker{since}: stop it first, give this one "
                                    "its own database, or start it with --standby to take "
                                    "over when that broker stops")
            if silent is not None:  # silent for takeover_after_s at least
                log.warning("taking over the metadata store %s: the broker holding it was "
                            "last heard from %.1f s ago", self.name, silent)
                self._end_other_brokers(holder)
            return False
        finally:
            if holder is not None:
                holder.close()

    def _silent_for(self, conn: Any) -> float | None:
        """Seconds since the holder's last heartbeat, by the server's clock (None: it has
        none yet)."""
        import psycopg

        try:
            row = conn.execute(
                "SELECT extract(epoch from clock_timestamp()) * 1000 - value::bigint FROM meta "
                "WHERE key = 'writer_heartbeat'").fetchone()
        except psycopg.errors.UndefinedTable:
            return None
        return None if row is None else float(row[0]) / 1000

    def _end_other_brokers(self, session: Any) -> None:
        """End every other broker's session on this database (the lock holder's too), from
        ``session`` (a new one: the standby's first connection may not outlive a server
        restart); this process's own sessions are spared."""
        mine = [session.info.backend_pid]
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            mine.append(self._conn.info.backend_pid)
        session.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
            "%s AND datname = current_database() AND pid <> ALL(%s)",
            (BROKER_APPLICATION, mine))

    def _heartbeat(self) -> None:
        """Say on the lock's session that this broker is alive (a standby takes over when
        it stops); nothing before the tables exist."""
        import psycopg

        with self._holder_lock:
            holder = self._holder
            if holder is None:
                return
            with suppress(psycopg.errors.UndefinedTable):
                holder.execute(
                    "INSERT INTO meta (key, value) VALUES ('writer_heartbeat', "
                    "(extract(epoch from clock_timestamp()) * 1000)::bigint::text) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value")

    def _beat(self) -> None:
        import psycopg

        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._heartbeat()
            except (psycopg.OperationalError, UnavailableError):
                # the statements wait for the server (or say it was lost)
                with suppress(UnavailableError):
                    self._check_holder()

    def _check_holder(self) -> None:
        """Before a writer uses a new session: its lock session must still be alive, or the
        lock taken again. Another broker holding it took the database over: lost."""
        import psycopg

        if self.read_only or not self.hold:
            return
        with self._holder_lock:
            if self.lost.is_set():
                raise UnavailableError(self.lost_reason)
            holder = self._holder
            if holder is not None:
                try:
                    holder.execute("SELECT 1")
                    return
                except psycopg.OperationalError:
                    holder.close()
                    self._holder = None
            holder = self._open(BROKER_APPLICATION)
            (got,) = holder.execute("SELECT pg_try_advisory_lock(%s)",
                                    (LOCK_KEY,)).fetchone()
            if got:
                self._holder = holder
                return
            holder.close()
            self.lost_reason = (f"another broker took the metadata store {self.name} over "
                                "while this one was not heard from")
            self.lost.set()
            raise UnavailableError(self.lost_reason)

    def _retrying(self, work: Any) -> Any:
        """``work(connection)``, opening the connection again while it is broken, with
        backoff, for up to the outage limit; then (or at once, once the backend was lost)
        UnavailableError naming the cause."""
        import psycopg

        pause, started = FIRST_PAUSE_S, time.monotonic()
        stale = True  # the first failure may be a session ended while idle: no pause, no word
        while True:
            if self.lost.is_set():
                raise UnavailableError(self.lost_reason)
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._connect()
                    self._check_holder()  # no write through a new session without the lock
                    if pause > FIRST_PAUSE_S:
                        log.warning("the metadata store %s is reachable again after %.1f s",
                                    self.name, time.monotonic() - started)
                return work(self._conn)
            except (psycopg.OperationalError, UnavailableError) as exc:
                if self.lost.is_set():  # taken over, or given up on: no waiting
                    raise UnavailableError(self.lost_reason) from None
                conn = self._conn
                if isinstance(exc, psycopg.OperationalError) and conn is not None \
                        and not conn.closed and not conn.broken:
                    raise  # the statement failed, not the connection
                if conn is not None and not conn.closed:
                    conn.close()
                self._conn = None
                if stale and conn is not None:  # a new session at once, said only if it fails
                    stale = False
                    continue
                waited = time.monotonic() - started
                if waited >= self.outage_limit_s:
                    self.lost_reason = (f"the metadata store {self.name} was unreachable for "
                                        f"{waited:.0f} s: {_first_line(exc)}")
                    self.lost.set()
                    raise UnavailableError(self.lost_reason) from None
                if pause == FIRST_PAUSE_S:
                    log.warning("the metadata store %s is unreachable (%s): metadata writes "
                                "wait for it, for up to %.0f s", self.name, _first_line(exc),
                                self.outage_limit_s)
                time.sleep(min(pause, max(0.0, self.outage_limit_s - waited)))
                pause = min(pause * 2, MAX_PAUSE_S)

    # -- the Backend interface ----------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        import psycopg

        def begin(c: Any) -> Any:
            # a session the server ended while idle (a restart) fails here, where nothing
            # was sent yet: _retrying opens a new one and begins again
            c.execute("BEGIN")
            return c

        with self._lock:
            conn = self._retrying(begin)
            try:
                with conn.cursor() as cur:
                    try:
                        yield _PgTx(cur)
                    except BaseException:
                        conn.execute("ROLLBACK")
                        raise
                conn.execute("COMMIT")
            except psycopg.OperationalError as exc:
                # the commit may not have reached the server: whatever depends on it fails
                if not conn.closed:
                    conn.close()
                self._conn = None
                raise UnavailableError(f"a metadata transaction on {self.name} did not "
                                       f"complete: {_first_line(exc)}") from None

    def read(self, sql: str, args: Args = ()) -> list[Any]:
        text = _translate(sql)
        with self._lock:
            rows: list[Any] = self._retrying(
                lambda c: c.execute(text, args or None).fetchall())
            return rows

    def refresh_statistics(self) -> None:
        """ANALYZE the segments table. Without statistics (a store filled faster than
        autovacuum analyzes it) PostgreSQL plans the per-partition binary search over
        segments as scans: a 10% window of 100 x 1,000 segments planned at 1.5/s instead of
        15.9/s after ANALYZE (the broker runs this when it opens the store)."""
        with self._lock:
            self._retrying(lambda c: c.execute("ANALYZE segments"))

    def columns(self, table: str) -> list[str]:
        return [r[0] for r in self.read(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? AND "
            "table_schema = current_schema()", (table,))]

    def close(self) -> None:
        self._stop.set()
        with self._lock, self._holder_lock:
            for conn in (self._conn, self._holder):
                if conn is not None and not conn.closed:
                    conn.close()
            self._conn = self._holder = None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
