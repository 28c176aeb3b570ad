"""How a ``partition_owners`` row reads: the :class:`Owner` of a partition (joined with where
its broker is reached), and the refusal that names it (``ownership.py`` writes the rows)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierstream.errors import NotOwnerError
from tierstream.metadata.backend import Tx

__all__ = ["OWNER_SELECT", "Owner", "owner_in", "owner_row", "owners_in", "refusal_text",
           "refused_in"]

OWNER_SELECT = ("SELECT o.broker_id, o.epoch, o.claimed_at, b.url, b.pulsar_url, {heard}, "
          "b.admin_url FROM partition_owners o LEFT JOIN brokers b ON b.broker_id = o.broker_id")


@dataclass(frozen=True)
class Owner:
    """The broker owning a partition: its id, the epoch of its claim, since when, and where
    it is reached (None until it said so)."""

    broker_id: str
    epoch: int
    claimed_at: int
    url: str | None = None
    pulsar_url: str | None = None
    #: ms since its lease was last renewed, by the metadata server's clock (None: never)
    heard_ms_ago: int | None = None
    admin_url: str | None = None  # its Pulsar admin REST, if it serves one

    def describe(self) -> str:
        where = f" at {self.url}" if self.url else ""
        return f"{self.broker_id}{where} (epoch {self.epoch})"

    def as_dict(self) -> dict[str, object]:
        return {"broker": self.broker_id, "epoch": self.epoch, "since": self.claimed_at,
                "url": self.url, "pulsar_url": self.pulsar_url, "admin_url": self.admin_url,
                "heard_ms_ago": self.heard_ms_ago}


def owners_in(c: Tx, topic: str) -> dict[int, tuple[str, int]]:
    """In ``c``: each owned partition of ``topic`` -> (broker id, epoch of its claim)."""
    return {int(p): (str(b), int(e)) for p, b, e in c.execute(
        "SELECT partition, broker_id, epoch FROM partition_owners WHERE topic=?",
        (topic,)).fetchall()}


def owner_in(c: Tx, topic: str, partition: int) -> Owner | None:
    row = c.execute(OWNER_SELECT.format(heard="NULL") + " WHERE o.topic=? AND o.partition=?",
                    (topic, partition)).fetchone()
    return None if row is None else owner_row(row)


def owner_row(row: Sequence[Any]) -> Owner:
    broker_id, epoch, claimed_at, url, pulsar_url, heard, admin_url = row
    return Owner(str(broker_id), int(epoch), int(claimed_at),
                 str(url) if url else None,  # '' until it advertised
                 None if pulsar_url is None else str(pulsar_url),
                 None if heard is None else int(heard),
                 None if admin_url is None else str(admin_url))


def refusal_text(topic: str, partition: int, owner: Owner | None, what: str) -> str:
    whose = f"is owned by {owner.describe()}" if owner is not None else \
        "is owned by no broker"
    return (f"cannot {what} {topic} partition {partition}: it {whose}, not by this one "
            "(it was taken over, or this broker's claim is gone)")


def refused_in(c: Tx, topic: str, partition: int, what: str) -> NotOwnerError:
    """In ``c``: the refusal to ``what`` a partition this broker does not own, naming whose
    it is."""
    return NotOwnerError(refusal_text(topic, partition, owner_in(c, topic, partition), what))
