"""Where a segment's copies go and how many must answer: the quorum rules (taking plain
numbers), network bookies found in the metadata (``tierstream bookie serve --metadata ...``
registers each with its address and host), and each segment's ensemble placed on available
bookies of distinct hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierstream.errors import ConfigError, UnavailableError
from tierstream.managed_ledger.bookies.client import BookieClient
from tierstream.managed_ledger.bookies.remote import RemoteBookie
from tierstream.metadata.bookie_registry import bookie_registration, network_bookies
from tierstream.metadata.store import MetadataStore

__all__ = ["DEFAULT_COPIES", "check_quorums", "choose_ensemble", "connect_network_bookies",
           "resolve_quorums"]

log = logging.getLogger(__name__)

#: copies of each entry when the write quorum is left to the number of network bookies
DEFAULT_COPIES = 3


def connect_network_bookies(metadata: MetadataStore, epoch: int, *, auth_token: str | None,
                            tls_ca: bytes | None, timeout_s: float
                            ) -> dict[str, BookieClient]:
    """A client of every bookie registered as writable, written under ``epoch``."""
    found = network_bookies(metadata)
    if not found:
        raise ConfigError("--network-bookies: no bookie is registered in the metadata store; "
                          "start them first (tierstream bookie serve --data-dir D --port P "
                          "--metadata postgresql://...)")
    def registered(bookie_id: str) -> Callable[[], tuple[str, str | None] | None]:
        return lambda: bookie_registration(metadata, bookie_id)

    bookies: dict[str, BookieClient] = {
        bookie_id: RemoteBookie(bookie_id, address, host=host, epoch=epoch, instance=instance,
                                registration=registered(bookie_id),
                                auth_token=auth_token, tls_ca=tls_ca, timeout_s=timeout_s)
        for bookie_id, address, host, instance in found}
    log.info("writing to %d network bookie(s): %s", len(bookies), ", ".join(
        f"{b} at {r.state()['where']} ({r.host})" for b, r in bookies.items()))
    return bookies


def check_quorums(write_quorum: int, ack_quorum: int, bookies: int) -> None:
    """The one check of the quorums: 1 <= ack <= write <= bookies (ConfigError naming the
    bad one)."""
    if not 1 <= write_quorum <= bookies:
        raise ConfigError(f"invalid writeQuorum {write_quorum}: must be between 1 and the "
                          f"number of bookies ({bookies})")
    if not 1 <= ack_quorum <= write_quorum:
        raise ConfigError(f"invalid ackQuorum {ack_quorum}: must be between 1 and "
                          f"writeQuorum ({write_quorum})")


def resolve_quorums(write_quorum: int, ack_quorum: int, bookies: int) -> tuple[int, int]:
    """(write quorum, ack quorum): as given; 0 (network bookies) resolves to as many copies
    as there are bookies up to :data:`DEFAULT_COPIES`, acked by a majority."""
    write_quorum = write_quorum or min(DEFAULT_COPIES, bookies)
    ack_quorum = ack_quorum or (write_quorum // 2 + 1)
    check_quorums(write_quorum, ack_quorum, bookies)
    return write_quorum, ack_quorum


def choose_ensemble(bookies: dict[str, BookieClient], write_quorum: int, ack_quorum: int,
                    turn: int, told: set[str] | None = None) -> tuple[str, ...]:
    """``write_quorum`` available bookies for a new segment, taking turns, on as many
    distinct hosts as there are: a host's loss then costs each segment one copy at most.
    With fewer available than the write quorum but at least the ack quorum, the segment
    gets those (under-replicated, said in the log once while the same bookies are
    unavailable, when the caller keeps ``told``); fewer: UnavailableError."""
    ids = list(bookies)
    order = [ids[(turn + i) % len(ids)] for i in range(len(ids))]
    up = [b for b in order if bookies[b].is_available()]
    chosen: list[str] = []
    hosts: set[str] = set()
    for b in up:  # one per host first
        host = bookies[b].host
        if host not in hosts and len(chosen) < write_quorum:
            chosen.append(b)
            hosts.add(host)
    for b in up:  # then any, if there are fewer hosts than copies
        if b not in chosen and len(chosen) < write_quorum:
            chosen.append(b)
    down = {b for b in order if b not in up}
    if len(chosen) < ack_quorum:
        raise UnavailableError(f"only {len(chosen)} bookie(s) available for a new segment "
                               f"(unavailable: {', '.join(sorted(down))}); the ack quorum is "
                               f"{ack_quorum}")
    if len(chosen) < write_quorum and (told is None or down != told):
        log.warning("new segments get %d copies, below the write quorum %d, while bookies "
                    "%s are unavailable", len(chosen), write_quorum, ", ".join(sorted(down)))
    if told is not None and down != told:
        told.clear()
        told.update(down)
    return tuple(chosen)
