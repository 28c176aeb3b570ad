"""A read-through cache of tier bytes on local disk, shared by every reader on a host.

The object store stays the source of truth; the cache only makes repeated and overlapping
reads of remote tier files local. Every tier read path of a process goes through
:func:`host_cache` (``tierstream.read``/``scan``, the CLI, Spark's tier splits on executors,
the broker's reads of offloaded segments: ``tier/host_cache.py`` says which cache that is),
and every process on a host that names the same directory shares one cache.

**Unit and key.** The cache fetches aligned blocks of ``BLOCK`` bytes of an object (the last
one shorter), one ranged GET each, and keeps each at its own offset in a sparse local copy of
the object, ``objects/<xx>/<id>``: a read of part of a file fetches only that part, and a file
held whole is memory-mapped by pyarrow as a local file is (no copy: ``open_whole``). An
object's id is a hash of the store (the S3 endpoint), the object's URL and its size. Tier file
names carry a fresh UUID per offload, so a re-created topic or a re-offloaded segment never
shares a name with what was cached before; another store's object of the same name differs
by endpoint.

**Index, atomicity, checksums.** ``index.sqlite3`` (WAL) holds a row per block: its size, its
CRC32C, when it was last used, and whether it is still being written. A block's bytes are
reserved (evicting first) before they are written, written in place, and only then marked
written with their checksum: a reader takes only marked blocks, so a half-written block (its
writer killed) is never read, and its reservation is dropped once abandoned. Every block is
checked against its CRC before use (a block held whole once per process and file); a
corrupt one is dropped and fetched again.

**Bound and eviction.** Sizes are summed in the index, so several processes together never
hold more than the limit. Eviction removes an object's whole local copy (unlinked: a reader
that has it mapped keeps reading it), least recently used first.

**Policy: scan-resistant admission (TinyLFU).** A backfill is a sequential scan, and a scan
larger than the cache flushes a plain LRU cache before any block is read again (a cache of
half the window then hits nothing on the next pass). Here, once the cache is full, a block is
admitted only if it has been asked for more often than the blocks of the object it would
evict (the history counts every access, resident or not, and is halved every few cache-sizes
of accesses so that old popularity fades). On a repeated scan twice the cache's size, the
first half stays and hits every time; a block read once does not displace one read twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import crc32c
import pyarrow as pa

from tierstream.errors import ConfigError

__all__ = ["BLOCK", "CacheStats", "ObjectRef", "Payload", "TierCache"]

log = logging.getLogger(__name__)

#: The cached unit: measured against 1 MiB and 16 MiB in ``python -m bench tier-cache``.
BLOCK = 4 * 1024**2
#: The default size: this share of the free disk where the cache lives, at most DEFAULT_CAP.
DEFAULT_SHARE = 0.1
DEFAULT_CAP = 20 * 1024**3
#: Blocks fetched from the store at once by one process (one ranged GET each).
FETCHERS = 16
#: How long opening the index waits for other processes opening it.
_OPEN_WAIT_S = 60.0
_SCHEMA = """
    CREATE TABLE IF NOT EXISTS blocks (
        key TEXT PRIMARY KEY, object TEXT NOT NULL, idx INTEGER NOT NULL,
        bytes INTEGER NOT NULL, crc INTEGER, used REAL NOT NULL, pending INTEGER NOT NULL);
    CREATE INDEX IF NOT EXISTS blocks_object ON blocks (object);
    CREATE TABLE IF NOT EXISTS history (key TEXT PRIMARY KEY, count INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
#: A reservation this old belongs to a writer that died.
_ABANDONED_S = 600.0
#: a block's bytes
Payload = bytes | memoryview
_COUNTERS = ("hits", "misses", "hit_bytes", "miss_bytes", "evictions", "rejected", "corrupt")


@dataclass(frozen=True)
class CacheStats:
    """What a cache holds and has done since it was created (or cleared), over every process
    that used it."""

    directory: str
    limit: int
    size: int
    entries: int
    hits: int
    misses: int
    hit_bytes: int
    miss_bytes: int
    evictions: int
    rejected: int  # fetched but not kept: asked for less often than what it would evict
    corrupt: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TierCache:
    """One cache directory, opened by this process. Thread-safe; see the module's text."""

    def __init__(self, directory: str | Path, limit: int | None = None, *,
                 block_size: int = BLOCK) -> None:
        self.directory = Path(directory)
        self.block_size = block_size
        try:
            (self.directory / "objects").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"invalid tier cache directory {str(self.directory)!r}: "
                              f"{exc.strerror or exc}") from None
        if limit is None:
            free = shutil.disk_usage(self.directory).free
            limit = min(DEFAULT_CAP, int(free * DEFAULT_SHARE))
        self.limit = limit
        self._lock = threading.Lock()  # the index connection, the in-flight fetches
        self._db = self._connect()
        self._flying: dict[str, Future[Payload]] = {}
        self._pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="tier-cache-fetch")
        #: blocks fetched ahead of their reader and kept: its read of one is not a second
        #: access (nor a hit), it is the miss the fetch counted
        self._prefetched: set[str] = set()
        #: local copies this process checked whole: (id, inode, mtime) - checked once
        self._verified: set[tuple[str, int, int]] = set()

    # -- the index ----------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        path = self.directory / "index.sqlite3"
        damaged = False
        deadline = time.monotonic() + _OPEN_WAIT_S
        while True:
            try:
                db = sqlite3.connect(path, timeout=_OPEN_WAIT_S, isolation_level=None,
                                     check_same_thread=False)
                # the switch to WAL takes the database alone and does not wait for others
                # that open it at the same moment (Spark's workers do): retried below
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(_SCHEMA)
                return db
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            except sqlite3.DatabaseError as exc:
                if damaged:
                    raise
                # a damaged index of a cache: start the cache over rather than fail reads
                log.warning("tier cache index %s is damaged (%s): starting the cache over",
                            path, exc)
                self._remove_all(with_index=True)
                damaged = True

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, serialised with every other process's."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @staticmethod
    def _size(db: sqlite3.Connection) -> int:
        """Bytes the cache holds or has reserved."""
        (size,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM blocks").fetchone()
        return int(size)

    @staticmethod
    def _count(db: sqlite3.Connection, **deltas: int) -> None:
        for name, delta in deltas.items():
            if delta:
                db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                           "SET value = value + excluded.value", (name, delta))

    def _seen(self, db: sqlite3.Connection, key: str) -> int:
        """Count one access of ``key`` in the history; its count, this access included. Every
        ``10 x`` the cache's blocks of accesses, every count is halved."""
        self._count(db, accesses=1)
        (accesses,) = db.execute("SELECT value FROM counters WHERE name = 'accesses'").fetchone()
        if accesses >= 10 * max(16, self.limit // self.block_size):  # halved before this one
            db.execute("UPDATE history SET count = count / 2")
            db.execute("DELETE FROM history WHERE count = 0")
            db.execute("UPDATE counters SET value = 0 WHERE name = 'accesses'")
        db.execute("INSERT INTO history VALUES (?, 1) ON CONFLICT(key) DO UPDATE "
                   "SET count = count + 1", (key,))
        (count,) = db.execute("SELECT count FROM history WHERE key = ?", (key,)).fetchone()
        return int(count)

    def _admit(self, obj: ObjectRef, index: int, nbytes: int) -> bool:
        """Count a miss of a block and reserve its ``nbytes`` if it is to be kept, evicting
        what it displaces; False when it is not kept (or is already, or is being written)."""
        key, ident = obj.block_key(index, self.block_size), obj.ident
        now = time.time()
        with self._write() as db:
            count = self._seen(db, key)
            self._count(db, misses=1, miss_bytes=nbytes)
            db.execute("DELETE FROM blocks WHERE pending = 1 AND used < ?",
                       (now - _ABANDONED_S,))  # their writers died
            if db.execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone():
                return False
            size = self._size(db)
            victims: list[str] = []
            if size + nbytes > self.limit:
                if nbytes > self.limit:
                    self._count(db, rejected=1)
                    return False
                freed = 0
                rows = db.execute(
                    "SELECT b.object, SUM(b.bytes), MAX(COALESCE(h.count, 0)) FROM blocks b "
                    "LEFT JOIN history h ON h.key = b.key WHERE b.object != ? "
                    "GROUP BY b.object ORDER BY MAX(b.used) LIMIT 256", (ident,)).fetchall()
                for victim, victim_bytes, victim_count in rows:
                    if victim_count >= count:  # TinyLFU: keep the more popular one
                        break
                    victims.append(victim)
                    freed += victim_bytes
                    if size - freed + nbytes <= self.limit:
                        break
                if size - freed + nbytes > self.limit:
                    self._count(db, rejected=1)
                    return False
            for victim in victims:
                self._evict(db, victim)
            db.execute("INSERT INTO blocks VALUES (?, ?, ?, ?, NULL, ?, 1)",
                       (key, ident, index, nbytes, now))
            return True

    def _evict(self, db: sqlite3.Connection, ident: str) -> None:
        """Remove an object's local copy, then its rows (a row without its bytes reads as a
        miss; bytes without a row would be what the bound does not count)."""
        with contextlib.suppress(FileNotFoundError):
            self._file(ident).unlink()
        (n,) = db.execute("SELECT COUNT(*) FROM blocks WHERE object = ?", (ident,)).fetchone()
        db.execute("DELETE FROM blocks WHERE object = ?", (ident,))
        self._count(db, evictions=int(n))

    # -- blocks ---------------------------------------------------------------------------------

    def _file(self, ident: str) -> Path:
        return self.directory / "objects" / ident[:2] / ident

    def _load(self, obj: ObjectRef, index: int) -> tuple[bytes, bool] | None:
        """A written block's bytes, checked against its CRC, and whether this is a hit
        (counted; False: it was fetched ahead for this read); None when it is not here (or
        corrupt: dropped, to be fetched again)."""
        key = obj.block_key(index, self.block_size)
        for attempt in range(2):
            row = self._db_read("SELECT bytes, crc FROM blocks WHERE key = ? AND pending = 0",
                                (key,))
            if row is None:
                return None
            nbytes, crc = row
            try:
                with self._file(obj.ident).open("rb") as f:
                    payload = os.pread(f.fileno(), nbytes, index * self.block_size)
            except FileNotFoundError:  # evicted just now
                return None
            if len(payload) == nbytes and crc32c.crc32c(payload) == crc:
                break
            # read again once: another process may have evicted the object between the
            # record and the read, and begun fetching it into a new file (a race, not
            # corruption); the same bad bytes twice are corrupt
            if attempt:
                self._corrupt(obj, [key])
                return None
        with self._lock:
            ahead = key in self._prefetched
            self._prefetched.discard(key)
        if ahead:  # fetched for this reader a moment ago: the miss is counted already
            return payload, False
        with self._write() as db:
            self._seen(db, key)
            db.execute("UPDATE blocks SET used = ? WHERE key = ?", (time.time(), key))
            self._count(db, hits=1, hit_bytes=nbytes)
        return payload, True

    def _db_read(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _corrupt(self, obj: ObjectRef, keys: list[str]) -> None:
        log.warning("tier cache: %d block(s) of %s are corrupt: dropped, fetched again",
                    len(keys), obj.path)
        with self._write() as db:
            for key in keys:
                db.execute("DELETE FROM blocks WHERE key = ?", (key,))
            self._count(db, corrupt=len(keys))

    def _store(self, obj: ObjectRef, index: int, payload: Payload) -> None:
        """Write a reserved block in place, then mark it written with its checksum."""
        key = obj.block_key(index, self.block_size)
        path = self._file(obj.ident)
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < obj.size:
                    os.ftruncate(fd, obj.size)  # sparse: blocks not written take no space
                os.pwrite(fd, payload, index * self.block_size)
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk: the read goes on, the block is not kept
            log.warning("tier cache could not keep a block of %s: %s", obj.path, exc)
            with self._write() as db:
                db.execute("DELETE FROM blocks WHERE key = ?", (key,))
            return
        with self._write() as db:  # no row any more: evicted meanwhile, nothing to mark
            db.execute("UPDATE blocks SET pending = 0, crc = ? WHERE key = ?",
                       (crc32c.crc32c(payload), key))

    def block(self, obj: ObjectRef, index: int) -> tuple[Payload, bool]:
        """Block ``index`` of ``obj`` and whether it came from the cache (else the store)."""
        kept = self._load(obj, index)
        if kept is not None:
            return kept
        key = obj.block_key(index, self.block_size)
        with self._lock:  # one fetch per block in this process; the others wait for it
            future = self._flying.get(key)
            mine = future is None
            if mine:
                future = self._flying[key] = Future()
        assert future is not None
        if not mine:  # a reader waiting for a fetch made ahead for it: that was its miss
            payload = future.result()
            with self._lock:
                self._prefetched.discard(key)
            return payload, False
        try:
            start = index * self.block_size
            payload = obj.read(start, min(start + self.block_size, obj.size))
            if self._admit(obj, index, len(payload)):
                self._store(obj, index, payload)
            future.set_result(payload)
            return payload, False
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._flying[key]

    def prefetch(self, obj: ObjectRef, indexes: list[int]) -> None:
        """Fetch ``indexes`` of ``obj`` ahead of their reader, in order, ``FETCHERS`` at a
        time: a reader asks for a block when pyarrow reads it, a few at once, which leaves
        the store's latency exposed. Only when the cache has room for all of them: a block
        fetched ahead and then not kept would be fetched twice."""
        for i in self._missing_that_fit(obj, indexes) or []:
            self._pool.submit(self._fetch_ahead, obj, i)

    def _missing_that_fit(self, obj: ObjectRef, indexes: list[int]) -> list[int] | None:
        """The blocks ``indexes`` of ``obj`` the cache neither holds nor is writing, if they
        fit without evicting; else None."""
        with self._lock:
            size = self._size(self._db)
            held = {i for (i,) in self._db.execute(
                "SELECT idx FROM blocks WHERE object = ?", (obj.ident,)).fetchall()}
        missing = [i for i in indexes if i not in held]
        return missing if size + len(missing) * self.block_size <= self.limit else None

    def _fetch_ahead(self, obj: ObjectRef, index: int) -> None:
        key = obj.block_key(index, self.block_size)
        with self._lock:
            self._prefetched.add(key)
        try:
            _, hit = self.block(obj, index)
        except Exception:  # the reader will ask again, and see the error itself
            hit = True
        if hit:
            with self._lock:
                self._prefetched.discard(key)

    def blocks(self, obj: ObjectRef, indexes: list[int]) -> list[tuple[Payload, bool]]:
        """Several blocks, the missing ones fetched at once."""
        if len(indexes) == 1:
            return [self.block(obj, indexes[0])]
        return list(self._pool.map(lambda i: self.block(obj, i), indexes))

    def fetch(self, obj: ObjectRef, indexes: list[int]) -> None:
        """Fetch the blocks ``indexes`` of ``obj`` the cache lacks into it, ``FETCHERS`` at a
        time, and wait for them (a reader about to read them all from a local copy)."""
        for future in [self._pool.submit(self.block, obj, i) for i in indexes]:
            future.result()

    def has_room(self, obj: ObjectRef, indexes: list[int]) -> bool:
        """Whether the blocks ``indexes`` of ``obj`` it lacks fit without evicting."""
        return self._missing_that_fit(obj, indexes) is not None

    def open_whole(self, obj: ObjectRef, *, count: bool = True
                   ) -> pa.MemoryMappedFile | None:
        """``obj``'s local copy, mapped, when the cache holds every block of it (checked
        against their CRCs once per process and copy), with the hits counted (``count``:
        False when its blocks were fetched for this very read); else None."""
        blocks = -(-obj.size // self.block_size)
        for attempt in range(2):
            with self._lock:
                rows = self._db.execute(
                    "SELECT key, idx, bytes, crc FROM blocks WHERE object = ? AND pending = 0",
                    (obj.ident,)).fetchall()
            if len({idx for _, idx, _, _ in rows if 0 <= idx < blocks}) != blocks:
                return None
            try:
                mapped = pa.memory_map(str(self._file(obj.ident)))  # evicted later: mapped
            except FileNotFoundError:
                return None
            st = os.fstat(mapped.fileno())
            seal = (obj.ident, st.st_ino, st.st_mtime_ns)
            if seal in self._verified:
                break
            whole = memoryview(mapped.read_buffer(obj.size))
            bad = [key for key, idx, nbytes, crc in rows
                   if crc32c.crc32c(whole[idx * self.block_size:
                                          idx * self.block_size + nbytes]) != crc]
            if not bad:
                self._verified.add(seal)
                break
            mapped.close()
            # as _load: another process may have evicted the object between the records and
            # the mapping and begun fetching it into a new file (a race, not corruption);
            # the same bad bytes twice are corrupt
            if attempt:
                self._corrupt(obj, bad)
                return None
        mapped.seek(0)
        if not count:
            return mapped
        now = time.time()
        with self._write() as db:
            for key, _, _, _ in rows:
                self._seen(db, key)
            db.execute("UPDATE blocks SET used = ? WHERE object = ?", (now, obj.ident))
            self._count(db, hits=len(rows), hit_bytes=obj.size)
        return mapped

    # -- what users see -------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._lock:
            counters = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
            size = self._size(self._db)
            (entries,) = self._db.execute("SELECT COUNT(*) FROM blocks").fetchone()
        return CacheStats(str(self.directory), self.limit, int(size), int(entries),
                          **{c: int(counters.get(c, 0)) for c in _COUNTERS})

    def clear(self) -> int:
        """Remove every block and reset the counters; returns the bytes freed."""
        with self._write() as db:
            size = self._size(db)
            self._remove_all(with_index=False)
            for table in ("blocks", "history", "counters"):
                db.execute(f"DELETE FROM {table}")
        return int(size)

    def _remove_all(self, *, with_index: bool) -> None:
        shutil.rmtree(self.directory / "objects", ignore_errors=True)
        (self.directory / "objects").mkdir(parents=True, exist_ok=True)
        if with_index:
            for name in ("index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"):
                (self.directory / name).unlink(missing_ok=True)


@dataclass(frozen=True)
class ObjectRef:
    """A remote object as the cache knows it: where (filesystem and path), its size, and its
    identity (``store``: the endpoint it came from)."""

    fs: Any
    path: str
    size: int
    store: str

    @functools.cached_property
    def ident(self) -> str:
        """The object's id in the cache: store, name and size."""
        return hashlib.sha256(f"{self.store}\n{self.path}\n{self.size}".encode()
                              ).hexdigest()[:40]

    def read(self, start: int, end: int) -> Payload:
        """Bytes ``start:end`` from the store: one ranged GET."""
        ranged = getattr(self.fs, "read_range", None)
        if ranged is not None:
            return ranged(self.path, start, end)  # type: ignore[no-any-return]
        return bytes(self.fs.cat_file(self.path, start=start, end=end))

    def block_key(self, index: int, block_size: int) -> str:
        return f"{self.ident}-{block_size}-{index}"
