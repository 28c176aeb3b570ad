"""The metadata store on PostgreSQL (``broker start --metadata postgresql://user@host/db``,
``TIERSTREAM_METADATA``), through psycopg 3.

**Transactions.** Every metadata transaction that is one SQLite transaction is one PostgreSQL
transaction (``Backend.transaction``), at READ COMMITTED. That is enough because two writers
never interleave: a broker holds the database with a session advisory lock for as long as it
runs (``leader_lease.py``: a second broker is refused, as the data directory's flock refuses
one for SQLite, and a standby takes over a silent one), and its own statements go through one
connection under one lock, as with SQLite; readers (the CLI, planners) only read, and every
write they could see is a committed whole.

**Failures.** While PostgreSQL cannot be reached, every metadata statement waits, trying
again with backoff (0.2 s doubling to 5 s): the acks that need a metadata write (cursor
commits, segment rolls) stop, everything else goes on, and all resume when the server is
back. After :func:`outage_limit_s` (60 s; ``TIERSTREAM_METADATA_OUTAGE_S``) the backend gives
up: the statement raises ``UnavailableError`` and :attr:`PostgresBackend.lost` is set, which
stops the broker cleanly with one line (``broker/run.py``). A connection that breaks in the
middle of a transaction fails that transaction (``UnavailableError``): nothing that depends on
it is acknowledged.

**A server that vanishes without a word** (its host cut off, powered off: no reset, no FIN)
would hold a statement for the kernel's retransmissions, about 15 minutes, and the outage
limit would never be applied. Every session therefore takes its server for gone after
:data:`DEAD_PEER_S` of silence — sent data unacknowledged (libpq's ``tcp_user_timeout``) or
keepalive probes unanswered on an idle connection (``keepalives_*``) — and asks the server to
do the same for it (``tcp_keepalives_*``, ``tcp_user_timeout``), so a broker's session whose
host vanished is ended and its lock freed. A parameter the URL sets itself wins
(``?keepalives_idle=30``).

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
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from tierstream.errors import ConfigError, UnavailableError
from tierstream.metadata.backend import Args, Cursor, Tx, UniqueViolation, first_line
from tierstream.metadata.leader_lease import BROKER_APPLICATION, LeaderLease

__all__ = ["PostgresBackend", "outage_limit_s", "safe_url"]

log = logging.getLogger(__name__)

#: the first pause before trying an unreachable server again, and the longest
FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 5.0
#: how long a session's peer may stay silent before the connection is taken for dead
DEAD_PEER_S = 10
#: keepalive probes from 4 s of idleness, every 2 s, 3 unanswered (4 + 2 * 3 = DEAD_PEER_S)
_KEEPALIVE = {"idle": "4", "interval": "2", "count": "3"}
#: libpq's parameters for it
_CLIENT_DEAD_PEER = {"keepalives": "1", **{f"keepalives_{k}": v for k, v in _KEEPALIVE.items()},
                     "tcp_user_timeout": str(DEAD_PEER_S * 1000)}
#: the server's settings for it, per session
_SERVER_DEAD_PEER = (*((f"tcp_keepalives_{k}", v) for k, v in _KEEPALIVE.items()),
                     ("tcp_user_timeout", str(DEAD_PEER_S * 1000)))


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


def _ask_server_to_watch(session: Any) -> None:
    """The server's dead-peer settings for ``session``, where it has them (a server that does
    not know one, or a pooler that refuses them, leaves the session as it is)."""
    import psycopg

    sets = ", ".join("set_config(%s, %s, false)" for _ in _SERVER_DEAD_PEER)
    try:
        session.execute(f"SELECT {sets}", [x for pair in _SERVER_DEAD_PEER for x in pair])
    except psycopg.Error as exc:
        if session.broken:
            raise UnavailableError(f"the metadata store's session ended as it opened: "
                                   f"{first_line(exc)}") from None
        log.debug("the metadata store's server keeps its own dead-peer settings: %s",
                  first_line(exc))


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
    """One PostgreSQL database. A writer (``read_only=False``: the broker) holds it with its
    :class:`~tierstream.metadata.leader_lease.LeaderLease` until :meth:`close`."""

    dialect = "postgresql"
    clock_ms = "(extract(epoch from clock_timestamp()) * 1000)::bigint"

    def __init__(self, url: str, *, read_only: bool = False,
                 takeover_after_s: float | None = None, hold: bool = True,
                 on_standby: Callable[[], None] | None = None) -> None:
        self.url = url
        self.hold = hold
        self.name = safe_url(url)
        self.read_only = read_only
        self._lock = threading.RLock()
        self._conn: Any = None
        self.outage_limit_s = outage_limit_s()
        #: set once the server stayed unreachable past the limit, or another broker took the
        #: database over, with the reason
        self.lost = threading.Event()
        self.lost_reason = ""
        #: set while a statement waits for the server, cleared when one reaches it again
        self.unreachable = threading.Event()
        self.connected_at = 0.0  # no session yet
        #: what the server shows as this backend's sessions' application_name (a cluster
        #: broker names its own: a taker ends those of a broker whose lease expired)
        self.application: str | None = None
        self._connect()
        #: a broker's hold on the database (hold=False: a bookie registering itself)
        self.lease = LeaderLease(self, takeover_after_s=takeover_after_s,
                                 on_standby=on_standby) \
            if not read_only and hold else None
        if self.lease is not None:
            self.lease.take()

    # -- connections --------------------------------------------------------------------------

    def open_session(self, application: str = "tierstream") -> Any:
        try:
            import psycopg
        except ImportError:  # pragma: no cover - a dependency of tierstream
            raise ConfigError("PostgreSQL metadata needs psycopg: pip install "
                              "'psycopg[binary]'") from None
        try:
            session = psycopg.connect(self.url, autocommit=True, connect_timeout=10,
                                      application_name=application, **self._dead_peer())
        except psycopg.ProgrammingError as exc:  # a malformed URL
            raise ConfigError(f"invalid metadata URL {self.name!r}: {first_line(exc)}") \
                from None
        except psycopg.OperationalError as exc:
            raise UnavailableError(f"cannot connect to the metadata store {self.name}: "
                                   f"{first_line(exc)}") from None
        _ask_server_to_watch(session)
        return session

    def _dead_peer(self) -> dict[str, Any]:
        """libpq's dead-peer parameters that the URL does not set itself."""
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        try:
            given = conninfo_to_dict(self.url)
        except psycopg.ProgrammingError:
            given = {}  # connect() says what is wrong with the URL
        return {k: v for k, v in _CLIENT_DEAD_PEER.items() if k not in given}

    def _connect(self) -> None:
        self._conn = self.open_session(self.application or (
            BROKER_APPLICATION if self.hold and not self.read_only else "tierstream"))
        self.connected_at = time.monotonic()
        if self.read_only:
            self._conn.read_only = True

    def name_sessions(self, application: str) -> None:
        """Name this backend's sessions ``application`` from now on, the open one too."""
        with self._lock:
            self.application = application
            conn = self._conn
            if conn is not None and not conn.closed and not conn.broken:
                conn.execute("SELECT set_config('application_name', %s, false)",
                             (application,))

    def close_session(self) -> None:
        """Close the statements' session (a broker refused the lock)."""
        if self._conn is not None and not self._conn.closed:
            self._conn.close()

    def session_pids(self) -> list[int]:
        """The server pid of the statements' session, if it is alive (a takeover spares it)."""
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return [conn.info.backend_pid]
        return []

    def lose(self, reason: str) -> None:
        """Give the database up for good: every statement raises UnavailableError(reason)."""
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

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
                    if self.lease is not None:  # no write through a new session without it
                        self.lease.check()
                    if pause > FIRST_PAUSE_S:
                        log.warning("the metadata store %s is reachable again after %.1f s",
                                    self.name, time.monotonic() - started)
                result = work(self._conn)
                self.unreachable.clear()
                return result
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
                    self.lose(f"the metadata store {self.name} was unreachable for "
                              f"{waited:.0f} s: {first_line(exc)}")
                    raise UnavailableError(self.lost_reason) from None
                self.unreachable.set()
                if pause == FIRST_PAUSE_S:
                    log.warning("the metadata store %s is unreachable (%s): metadata writes "
                                "wait for it, for up to %.0f s", self.name, first_line(exc),
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
                                       f"complete: {first_line(exc)}") from None

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
        if self.lease is not None:
            self.lease.release()
        with self._lock:
            self.close_session()
            self._conn = None
