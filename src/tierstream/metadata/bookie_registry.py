"""What the metadata keeps for bookies as network services and for the brokers writing to
them: the writable bookies (``tierstream bookie serve --metadata ...`` registers itself
through :func:`set_bookie_endpoint`, as a broker does for the read endpoints of its own
bookies), and the writer epoch each broker takes
when it opens the store (bookies fence ledgers by it).
"""

from __future__ import annotations

import json
from dataclasses import replace

from tierstream.metadata.records import SegmentRecord
from tierstream.metadata.store import MetadataStore
from tierstream.timeutil import now_ms

__all__ = ["network_bookies", "set_bookie_endpoint", "set_ensemble", "take_writer_epoch"]


def set_bookie_endpoint(metadata: MetadataStore, bookie_id: str, address: str, *,
                        host: str | None = None, writable: bool = False) -> None:
    """Record where readers on other hosts reach ``bookie_id`` (its advertised address); a
    ``writable`` one (``tierstream bookie serve``) also takes a broker's writes, and ``host``
    names the machine it runs on (copies of a segment go to distinct hosts)."""
    with metadata.atomic() as c:
        c.execute("INSERT INTO bookie_endpoints (bookie_id, address, updated_at, host, "
                  "writable) VALUES (?, ?, ?, ?, ?) ON CONFLICT(bookie_id) DO UPDATE SET "
                  "address=excluded.address, updated_at=excluded.updated_at, "
                  "host=excluded.host, writable=excluded.writable",
                  (bookie_id, address, now_ms(), host, int(writable)))


def network_bookies(metadata: MetadataStore) -> list[tuple[str, str, str]]:
    """(bookie id, address, host) of every bookie that takes writes over the network."""
    return [(b, a, h or a) for b, a, h in metadata.query(
        "SELECT bookie_id, address, host FROM bookie_endpoints WHERE writable=1 "
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


def set_ensemble(metadata: MetadataStore, seg: SegmentRecord, ensemble: tuple[str, ...]
                 ) -> SegmentRecord:
    """Record that a closed segment's copies are now on ``ensemble`` (re-replication)."""
    with metadata.atomic() as c:
        c.execute("UPDATE segments SET ensemble=? WHERE segment_id=?",
                  (json.dumps(list(ensemble)), seg.segment_id))
    return replace(seg, ensemble=ensemble)
