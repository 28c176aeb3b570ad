"""What the metadata keeps for bookies as network services and for the brokers writing to
them: the writable bookies (``tierstream bookie serve --metadata ...`` registers itself
through :func:`set_bookie_endpoint`, as a broker does for the read endpoints of its own
bookies) with the instance their disk's cookie names (``bookie/cookie.py``), and the writer
epoch each broker takes when it opens the store (bookies fence ledgers by it).
"""

from __future__ import annotations

from tierstream.metadata.backend import Tx
from tierstream.metadata.replication import mark_under_replicated, segments_with_bookie
from tierstream.metadata.store import MetadataStore
from tierstream.util.timeutil import now_ms

__all__ = ["bookie_registration", "network_bookies", "registered_instance", "replace_bookie",
           "set_bookie_endpoint", "take_writer_epoch"]


def set_bookie_endpoint(metadata: MetadataStore, bookie_id: str, address: str, *,
                        host: str | None = None, writable: bool = False,
                        instance: str | None = None) -> None:
    """Record where readers on other hosts reach ``bookie_id`` (its advertised address); a
    ``writable`` one (``tierstream bookie serve``) also takes a broker's writes, ``host``
    names the machine it runs on (copies of a segment go to distinct hosts), and
    ``instance`` the cookie on its disk (kept when None)."""
    with metadata.atomic() as c:
        _register(c, bookie_id, address, host, writable, instance)


def _register(c: Tx, bookie_id: str, address: str, host: str | None, writable: bool,
              instance: str | None) -> None:
    c.execute("INSERT INTO bookie_endpoints (bookie_id, address, updated_at, host, "
              "writable, instance) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(bookie_id) DO UPDATE "
              "SET address=excluded.address, updated_at=excluded.updated_at, "
              "host=excluded.host, writable=excluded.writable, "
              "instance=COALESCE(excluded.instance, bookie_endpoints.instance)",
              (bookie_id, address, now_ms(), host, int(writable), instance))


def registered_instance(metadata: MetadataStore, bookie_id: str) -> tuple[bool, str | None]:
    """(whether ``bookie_id`` is registered, the instance its registration names: None for
    one registered before bookies had cookies)."""
    rows = metadata.query("SELECT instance FROM bookie_endpoints WHERE bookie_id=?",
                          (bookie_id,))
    return (bool(rows), rows[0][0] if rows else None)


def bookie_registration(metadata: MetadataStore, bookie_id: str
                        ) -> tuple[str, str | None] | None:
    """(address, instance) of ``bookie_id``'s registration, or None: where the broker finds it
    when the address it had stops answering (the bookie restarted elsewhere), and which disk
    is the bookie (one that replaced a lost disk)."""
    rows = metadata.query("SELECT address, instance FROM bookie_endpoints WHERE bookie_id=?",
                          (bookie_id,))
    return (str(rows[0][0]), rows[0][1]) if rows else None


def replace_bookie(metadata: MetadataStore, bookie_id: str, address: str, *, host: str,
                   instance: str) -> tuple[list[int], int]:
    """A new disk takes the place of ``bookie_id``'s lost one: in one transaction, the
    registration names the new ``instance``, and every segment the lost instance held a copy
    of is listed as under-replicated (its copies there are gone). Returns those segments and
    the first segment id the new disk can have had nothing of: it takes no appends for
    earlier ones, whose entries and fences it lost (a writer fenced there, a zombie, would
    find it open). Not an epoch floor: on a cluster, live brokers of older epochs write."""
    with metadata.atomic() as c:
        _register(c, bookie_id, address, host, True, instance)
        lost = segments_with_bookie(metadata, bookie_id, tx=c)
        mark_under_replicated(metadata, [(s, f"bookie {bookie_id} was replaced: its disk "
                                          "and the copies on it were lost") for s in lost], tx=c)
        (newest,) = c.execute("SELECT MAX(segment_id) FROM segments").fetchone()
    return lost, int(newest or 0) + 1


def network_bookies(metadata: MetadataStore) -> list[tuple[str, str, str, str | None]]:
    """(bookie id, address, host, instance) of every bookie that takes writes over the
    network."""
    return [(b, a, h or a, i) for b, a, h, i in metadata.query(
        "SELECT bookie_id, address, host, instance FROM bookie_endpoints WHERE writable=1 "
        "ORDER BY bookie_id")]


def take_writer_epoch(metadata: MetadataStore) -> int:
    """A new writer epoch, above every earlier one: a broker opening the store writes under
    it, and bookies refuse a ledger's writes from lower epochs once it fenced it."""
    with metadata.atomic() as c:
        c.execute("INSERT INTO meta (key, value) VALUES ('writer_epoch', '0') "
                  "ON CONFLICT (key) DO NOTHING")
        (value,) = c.execute("SELECT value FROM meta WHERE key='writer_epoch'").fetchone()
        epoch = int(value) + 1
        c.execute("UPDATE meta SET value=? WHERE key='writer_epoch'", (str(epoch),))
    return epoch
