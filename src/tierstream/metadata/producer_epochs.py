"""The topic epoch of each partition's exclusive producers (``broker/topics/producer_access.py``),
kept in the metadata store as Pulsar keeps it in the topic's metadata: a producer that lost
the partition to another is fenced when it comes back even after a broker restart or a
standby's takeover. One row of ``meta`` per partition that ever had an exclusive producer."""

from __future__ import annotations

from tierstream.metadata.store import MetadataStore

__all__ = ["MetadataEpochs"]


class MetadataEpochs:
    """``producer_access.Epochs`` over a metadata store."""

    def __init__(self, metadata: MetadataStore) -> None:
        self.metadata = metadata

    def load(self, topic: str, partition: int) -> int:
        rows = self.metadata.query("SELECT value FROM meta WHERE key = ?",
                                   (_key(topic, partition),))
        return int(rows[0][0]) if rows else -1

    def save(self, topic: str, partition: int, epoch: int) -> None:
        with self.metadata.atomic() as c:
            c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                      "SET value = excluded.value", (_key(topic, partition), str(epoch)))


def _key(topic: str, partition: int) -> str:
    return f"producer_epoch/{topic}/{partition}"
