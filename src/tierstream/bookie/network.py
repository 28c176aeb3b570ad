"""The broker's bookies when they are network services (``broker start --network-bookies``):
found in the metadata, where ``tierstream bookie serve --metadata ...`` registers each with
its address and host; quorums resolved from how many there are; and each segment's ensemble
placed on available bookies of distinct hosts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tierstream.bookie.ledger import IndexRecord
from tierstream.bookie.remote import RemoteBookie
from tierstream.bookie.storage import Bookie
from tierstream.errors import ConfigError, UnavailableError
from tierstream.metadata.bookie_registry import network_bookies

if TYPE_CHECKING:  # the config is the broker's; a bookie module does not import it to run
    from tierstream.broker.config import StoreConfig
    from tierstream.metadata.store import MetadataStore

__all__ = ["AnyBookie", "available", "bookie_state", "choose_ensemble",
           "connect_network_bookies", "host_of", "raw_frames", "resolve_quorums"]

log = logging.getLogger(__name__)

#: a bookie in this directory's process, or one over the network
AnyBookie = Bookie | RemoteBookie

#: copies of each entry when the write quorum is left to the number of network bookies
DEFAULT_COPIES = 3


def connect_network_bookies(config: StoreConfig, metadata: MetadataStore, epoch: int
                            ) -> dict[str, AnyBookie]:
    """A client of every bookie registered as writable, written under ``epoch``."""
    found = network_bookies(metadata)
    if not found:
        raise ConfigError("--network-bookies: no bookie is registered in the metadata store; "
                          "start them first (tierstream bookie serve --data-dir D --port P "
                          "--metadata postgresql://...)")
    bookies: dict[str, AnyBookie] = {}
    for bookie_id, address, host in found:
        bookies[bookie_id] = RemoteBookie(
            bookie_id, address, host=host, epoch=epoch, auth_token=config.bookie_token,
            tls_ca=config.bookie_tls_ca, timeout_s=config.bookie_timeout_s)
    log.info("writing to %d network bookie(s): %s", len(bookies), ", ".join(
        f"{b} at {r.address} ({r.host})" for b, r in bookies.items()
        if isinstance(r, RemoteBookie)))
    return bookies


def resolve_quorums(config: StoreConfig, bookies: int) -> tuple[int, int]:
    """(write quorum, ack quorum): as configured; for network bookies left at 0, as many
    copies as there are bookies up to :data:`DEFAULT_COPIES`, acked by a majority."""
    write_quorum = config.write_quorum or min(DEFAULT_COPIES, bookies)
    ack_quorum = config.ack_quorum or (write_quorum // 2 + 1)
    if not 1 <= write_quorum <= bookies:
        raise ConfigError(f"invalid writeQuorum {write_quorum}: must be between 1 and the "
                          f"number of bookies ({bookies})")
    if not 1 <= ack_quorum <= write_quorum:
        raise ConfigError(f"invalid ackQuorum {ack_quorum}: must be between 1 and "
                          f"writeQuorum ({write_quorum})")
    return write_quorum, ack_quorum


def available(bookie: AnyBookie) -> bool:
    """Whether a bookie takes writes now (a network one that was down is pinged)."""
    return not isinstance(bookie, RemoteBookie) or bookie.available or bookie.ping()


def choose_ensemble(bookies: dict[str, AnyBookie], write_quorum: int, ack_quorum: int,
                    turn: int) -> tuple[str, ...]:
    """``write_quorum`` available bookies for a new segment, taking turns, on as many
    distinct hosts as there are: a host's loss then costs each segment one copy at most.
    With fewer available than the write quorum but at least the ack quorum, the segment
    gets those (under-replicated, said in the log); fewer: UnavailableError."""
    ids = list(bookies)
    order = [ids[(turn + i) % len(ids)] for i in range(len(ids))]
    up = [b for b in order if available(bookies[b])]
    chosen: list[str] = []
    hosts: set[str] = set()
    for b in up:  # one per host first
        host = host_of(bookies[b])
        if host not in hosts and len(chosen) < write_quorum:
            chosen.append(b)
            hosts.add(host)
    for b in up:  # then any, if there are fewer hosts than copies
        if b not in chosen and len(chosen) < write_quorum:
            chosen.append(b)
    if len(chosen) < ack_quorum:
        down = [b for b in order if b not in up]
        raise UnavailableError(f"only {len(chosen)} bookie(s) available for a new segment "
                               f"(unavailable: {', '.join(down)}); the ack quorum is "
                               f"{ack_quorum}")
    if len(chosen) < write_quorum:
        log.warning("a new segment gets %d copies, below the write quorum %d: bookies %s "
                    "are unavailable", len(chosen), write_quorum,
                    ", ".join(b for b in order if b not in up))
    return tuple(chosen)


def host_of(bookie: AnyBookie) -> str:
    return bookie.host if isinstance(bookie, RemoteBookie) else "local"


def raw_frames(bookie: AnyBookie, segment_id: int, records: list[IndexRecord]
               ) -> list[tuple[IndexRecord, bytes]]:
    """The stored frames of ``records``, as they are (recovery and re-replication copy
    them to other bookies)."""
    if isinstance(bookie, RemoteBookie):
        return list(bookie.read_raw_frames(segment_id, records))
    return [(rec, bookie.read_raw_frame(segment_id, rec)) for rec in records]


def bookie_state(bookie: AnyBookie) -> dict[str, Any]:
    """What ``broker stats`` says of a bookie."""
    if not isinstance(bookie, RemoteBookie):
        return {"where": str(bookie.root), "host": "local", "available": True}
    return {"where": bookie.address, "host": bookie.host, "available": bookie.available,
            "failures": bookie.failures,
            **({} if bookie.available else {"unavailable_because": bookie.down_reason})}
