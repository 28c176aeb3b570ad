"""The subscriptions' cursors in the metadata store (table ``cursors``): one row per
subscription and partition, its state as JSON (``broker/subscriptions/cursor_state.py``).
A part of :class:`~tierstream.metadata.store.MetadataStore`."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from tierstream.metadata.backend import Tx

__all__ = ["CursorRows"]

log = logging.getLogger("tierstream.metadata.store")


class CursorRows:
    """The cursor rows of a metadata store (its ``atomic``, ``query``, ``_one``, ``owner``)."""

    owner: Any  # metadata/owner_rows.py's Owner of this broker, or None

    def atomic(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def get_cursor(self, topic: str, subscription: str, partition: int) -> Any:
        """A subscription's stored partition state (subscriptions/cursor_state.py), or None."""
        row = self._one(
                "SELECT state FROM cursors WHERE topic=? AND subscription=? AND partition=?",
                (topic, subscription, partition),
            )
        return None if row is None else json.loads(row[0])

    def cursors(self, topic: str) -> list[dict[str, Any]]:
        """Every stored cursor of ``topic``: subscription, partition, state, updated_at."""
        rows = self.query(
                "SELECT subscription, partition, state, updated_at FROM cursors WHERE topic=? "
                "ORDER BY subscription, partition", (topic,))
        return [{"subscription": r[0], "partition": r[1], "state": json.loads(r[2]),
                 "updated_at": r[3]} for r in rows]

    def save_cursors(self, rows: Sequence[tuple[str, str, int, Any]], *, now: int
                     ) -> dict[tuple[str, int], str]:
        """Store ``(topic, subscription, partition, state)`` rows in one transaction. A row
        of a partition another broker owns now is not written over its cursor, and the
        others are. Returns the partitions not stored, with their owner's id: whoever
        waits on such a row must not say it is stored (its client sends it there)."""
        with self.atomic() as c:
            foreign = {} if self.owner is None else self.owner.foreign(
                c, {(t, p) for t, _, p, _ in rows})
            if foreign:
                log.warning("cursors not stored, of partitions other brokers own now (what "
                            "waits on them is refused, naming the owner): %s",
                            sorted(foreign)[:5])
                rows = [r for r in rows if (r[0], r[2]) not in foreign]
            c.executemany(
                "INSERT INTO cursors (topic, subscription, partition, state, updated_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, subscription, partition) DO UPDATE "
                "SET state=excluded.state, updated_at=excluded.updated_at",
                [(t, sub, p, json.dumps(state), now) for t, sub, p, state in rows],
            )
        return foreign

    def delete_cursors(self, topic: str, subscription: str) -> int:
        """Forget a subscription of ``topic`` (every partition's cursor); how many went."""
        with self.atomic() as c:
            return int(c.execute("DELETE FROM cursors WHERE topic=? AND subscription=?",
                                 (topic, subscription)).rowcount)
