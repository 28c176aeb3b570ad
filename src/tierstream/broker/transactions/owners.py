"""A transaction's partitions served by the other brokers of a cluster (``--cluster``).

A transaction's entries are staged by the owner of each partition they go to (the writer's
staging streams follow the owners, as a producer's do), and its decision is one metadata
transaction that any broker can make. So the broker asked to prepare a transaction asks the
other owners how many rows they hold of it, and the broker that committed it asks each of
them to show its entries (``TransactionCoordinator.here``: action ``txn-here``), as Pulsar's
transaction coordinator sends each partition's owner the end of a transaction. An owner that
does not answer (down, moving the partition) leaves the transaction COMMITTED: every broker's
housekeeping asks again, a partition's next owner shows its entries when it recovers
the partition (the decision is in the metadata it reads), and an owner shows them before a
transaction stages anything more to the partition (``TransactionCoordinator.stage``), so a
transaction committed later comes after it there. An abort is told to every other live
broker the same way (an attempt aborted before it prepared may have staged where no record
of it says); one that misses it learns it at its next housekeeping pass.

A commit is atomic per broker: a reader of partitions served by two brokers may see one's
entries a moment before the other's (as with Pulsar), never some of one partition's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from tierstream.broker.peers import Peers
from tierstream.errors import UnavailableError
from tierstream.metadata.ownership import PartitionOwners

__all__ = ["TxnOwners"]

log = logging.getLogger(__name__)


class _Store(Protocol):
    owners: PartitionOwners

    def serves(self) -> set[tuple[str, int]]: ...


class TxnOwners:
    """The owners of partitions ``store`` does not serve, asked through ``peers``."""

    def __init__(self, store: _Store, peers: Peers,
                 live: Callable[[], Mapping[str, str]] = dict) -> None:
        self.store = store
        self.peers = peers
        #: the other brokers live at the cluster's last look: {broker id: url}
        self._live = live

    def serves(self, topic: str, partition: int) -> bool:
        return (topic, partition) in self.store.serves()

    def check_serving(self, topic: str, partition: int) -> None:
        """NotOwnerError naming the owner, when another broker owns the partition."""
        self.store.owners.serving(topic, partition)

    def _by_owner(self, parts: Iterable[tuple[str, int]]
                  ) -> tuple[dict[str, list[tuple[str, int]]], list[tuple[str, int]]]:
        """``parts`` by the address of their owner (by the metadata), and those with no
        owner reached anywhere (being taken over)."""
        by_url: dict[str, list[tuple[str, int]]] = {}
        nobody: list[tuple[str, int]] = []
        for topic, partition in sorted(set(parts)):
            owner = self.store.owners.owner_of(topic, partition)
            if owner is None or owner.url is None or owner.broker_id == \
                    self.store.owners.broker_id:
                nobody.append((topic, partition))
            else:
                by_url.setdefault(owner.url, []).append((topic, partition))
        return by_url, nobody

    def _ask(self, op: str, txn_ids: list[str], parts: Iterable[tuple[str, int]], *,
             everyone: bool = False) -> tuple[list[Any], list[str]]:
        """``op`` asked of every owner of ``parts`` (and of every other live broker, if
        ``everyone``) side by side: their answers, and what went unanswered, one line per
        owner (or partition with none)."""
        by_url, nobody = self._by_owner(parts)
        if everyone:
            for url in self._live().values():
                by_url.setdefault(url, [])
        problems = [f"{t} partition {p}: no broker serves it now (it is being taken over)"
                    for t, p in nobody]
        answers = self.peers.call_each({url: ("txn-here", {
            "op": op, "txns": txn_ids, "parts": [list(k) for k in asked]})
            for url, asked in by_url.items()})
        out = []
        for url, answer in answers.items():
            names = ", ".join(f"{t} partition {p}" for t, p in by_url[url]) or url
            if isinstance(answer, Exception):
                problems.append(f"{names}: the owner at {url} did not answer ({answer})")
                continue
            if answer["not_here"]:
                moved = ", ".join(f"{t} partition {p}" for t, p in answer["not_here"])
                problems.append(f"{moved}: moved from {url} while it was asked")
            out.append(answer)
        return out, problems

    def staged(self, txn_id: str, parts: Iterable[tuple[str, int]]
               ) -> dict[tuple[str, int], int]:
        """The rows ``txn_id`` staged in ``parts``, as their owners count them; one that
        does not answer makes it UnavailableError (the writer prepares again, or aborts)."""
        answers, problems = self._ask("staged", [txn_id], parts)
        if problems:
            raise UnavailableError(f"cannot prepare transaction {txn_id}: "
                                   f"{'; '.join(problems)}")
        return {(str(t), int(p)): int(n) for a in answers for t, p, n in a["staged"]}

    def apply(self, txn_ids: list[str], parts: Iterable[tuple[str, int]]) -> list[str]:
        """Ask the owners of ``parts`` to show the committed ``txn_ids``' entries: what did
        not answer (empty: all did)."""
        _, problems = self._ask("apply", txn_ids, parts)
        if problems:
            log.info("committed transaction(s) %s are not shown everywhere yet (asked again at "
                     "the next housekeeping pass): %s", ", ".join(txn_ids), "; ".join(problems))
        return problems

    def end(self, txn_ids: list[str], parts: Iterable[tuple[str, int]]) -> None:
        """Tell the owners of ``parts``, and every other live broker, that ``txn_ids`` ended
        (aborted): best effort. Every one: an attempt aborted before it prepared (its
        writer's other stream failed, or another attempt of its batch committed) may have
        staged where no record of it says, and there its entries would hold up every entry
        after them until that broker's next transaction pass (up to 10 s)."""
        _, problems = self._ask("end", txn_ids, parts, everyone=True)
        if problems:
            log.info("aborted transaction(s) %s: not every owner heard it now (each learns it "
                     "at its next housekeeping pass): %s", ", ".join(txn_ids),
                     "; ".join(problems))
