"""One Iceberg table per topic (pyiceberg), so the cold past is a lakehouse table too.

The default catalog is pyiceberg's SqlCatalog on ``catalog.db`` in the data directory, with its
warehouse (Iceberg metadata files) under the tier URL; ``catalogUri`` points it elsewhere.
Registration is idempotent: a file already in the table's current snapshot is not added again,
which is what makes a retry after "the commit raised but had committed" safe.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from tierstream.errors import UnavailableError
from tierstream.names import TopicName
from tierstream.schema import MESSAGE_SCHEMA
from tierstream.store.tier import TierStorage

__all__ = ["TierCatalog", "iceberg_identifier"]

log = logging.getLogger(__name__)


def iceberg_identifier(topic: TopicName) -> tuple[str, str, str]:
    """``(tenant, namespace, topic)`` with '.' spelled ``_dot_``: Iceberg namespaces split on
    dots, and topic components may contain them."""
    return tuple(p.replace(".", "_dot_") for p in topic.path_parts)  # type: ignore[return-value]


class TierCatalog:
    """Registers offloaded files in their topic's Iceberg table."""

    def __init__(self, uri: str, tier: TierStorage) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        self.uri = uri
        self.tier = tier
        self._tables: dict[tuple[str, str, str], Any] = {}
        try:
            self._catalog = SqlCatalog("tierstream", uri=uri, warehouse=tier.warehouse_url(),
                                       **tier.iceberg_properties())
        except Exception as exc:
            raise UnavailableError(f"cannot open the Iceberg catalog at {uri!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"TierCatalog(uri={self.uri!r})"

    def table(self, topic: TopicName) -> Any:
        """The topic's table as of the catalog's current snapshot (created on first use)."""
        ident = iceberg_identifier(topic)
        table = self._tables.get(ident)
        if table is not None:
            table.refresh()  # cheaper than loading; sees commits made since
            return table
        self._catalog.create_namespace_if_not_exists(ident[:2])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = self._catalog.create_table_if_not_exists(ident, schema=MESSAGE_SCHEMA)
        self._tables[ident] = table
        return table

    def registered_files(self, topic: TopicName) -> list[str]:
        table = self.table(topic)
        if table.current_snapshot() is None:
            return []
        return list(table.inspect.files().column("file_path").to_pylist())

    def register(self, topic: TopicName, url: str) -> bool:
        """Add ``url`` to the topic's table unless it is there already; True if added."""
        if url in self.registered_files(topic):
            return False
        self._tables[iceberg_identifier(topic)].add_files([url], check_duplicate_files=True)
        return True

    def unregister(self, topic: TopicName, url: str, segment_id: int) -> bool:
        """Remove the file of ``segment_id`` from the table (metadata only); True if removed."""
        if url not in self.registered_files(topic):
            return False
        from pyiceberg.expressions import EqualTo

        equal_to: Any = EqualTo  # pyiceberg's pydantic signature confuses mypy
        self.table(topic).delete(delete_filter=equal_to("segment_id", segment_id))
        return True
