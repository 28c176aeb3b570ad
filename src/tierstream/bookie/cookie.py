"""A network bookie's identity: the cookie on its disk, matched with its registration.

BookKeeper writes a *cookie* on a bookie's disks and in its metadata store at the bookie's
first start, and refuses to start a bookie whose disks do not carry the cookie its
registration names: an empty disk (replaced, or wiped) or another bookie's disk is never taken
for the old one, whose copies are gone. tierstream does the same for ``bookie serve
--metadata``. The cookie is the file ``COOKIE`` in the bookie's directory (JSON: bookie id,
instance, when it was made, the lowest writer epoch the disk accepts), written atomically and
fsync'd; the registration (``bookie_endpoints.instance``) names the instance.

At start (:func:`claim_identity`):

==========================  ==========================================================
the directory               what happens
==========================  ==========================================================
its cookie matches          the bookie serves as itself
no cookie, nothing lost     a new instance (a new bookie, or one that never held a copy)
no cookie, copies lost      refused, naming the fix: ``--replace`` takes the lost one's
                            place, listing every copy it held as under-replicated at
                            once (``metadata/replication.py``); the brokers re-replicate
another bookie's cookie     refused (the wrong disk, or another store's)
==========================  ==========================================================

A replacing disk takes no appends for the ledgers that predate it (``first_ledger``, at any
epoch): the fences the lost disk kept (``storage.py``) are gone with it, and a broker fenced
there must not write through them. It is not an epoch floor: on a cluster, brokers of older
epochs than the newest live and write new ledgers.
The registration is written before the cookie, so a crash between the two leaves a state the
next start resolves (an empty directory, registered): never a cookie the store does not know.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tierstream.errors import ConfigError, CorruptionError
from tierstream.metadata.bookie_registry import (
    registered_instance,
    replace_bookie,
    set_bookie_endpoint,
)
from tierstream.metadata.replication import segments_with_bookie
from tierstream.metadata.store import MetadataStore
from tierstream.util.durable import fsync_dir
from tierstream.util.timeutil import now_ms

__all__ = ["COOKIE", "Cookie", "check_identity", "claim_identity", "read_cookie"]

COOKIE = "COOKIE"


@dataclass(frozen=True)
class Cookie:
    bookie_id: str
    instance: str
    created_at: int
    #: ledgers below this one predate the disk (it replaced a lost one): they take no
    #: appends here, whatever the writer's epoch (0: none)
    first_ledger: int = 0


def read_cookie(root: Path) -> Cookie | None:
    """The cookie of the bookie directory ``root`` (None: it has none)."""
    path = root / COOKIE
    try:
        raw = json.loads(path.read_text())
        return Cookie(str(raw["bookie_id"]), str(raw["instance"]), int(raw["created_at"]),
                      int(raw.get("first_ledger") or 0))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"the bookie cookie {str(path)!r} is unreadable ({exc}): "
                              "restore it, or start on an empty directory with --replace") \
            from None


def _write_cookie(root: Path, cookie: Cookie) -> None:
    path = root / COOKIE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(asdict(cookie)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def _holds_ledgers(root: Path) -> bool:
    ledgers = root / "ledgers"
    return ledgers.is_dir() and any(any(os.scandir(d.path)) for d in os.scandir(ledgers)
                                    if d.is_dir())


def claim_identity(root: Path, bookie_id: str, metadata: MetadataStore, *, address: str,
                   host: str, replace: bool = False) -> tuple[Cookie, list[int]]:
    """Match the directory's cookie with ``bookie_id``'s registration and register the
    bookie at ``address``: (its cookie, the segments listed under-replicated because it
    replaced a lost disk). ConfigError, naming the fix, where the table above refuses."""
    cookie, lost_copies = _inspect(root, bookie_id, metadata, replace)
    if cookie is not None:
        set_bookie_endpoint(metadata, bookie_id, address, host=host, writable=True,
                            instance=cookie.instance)
        return cookie, []
    fresh = Cookie(bookie_id, uuid.uuid4().hex, now_ms())
    lost: list[int] = []
    if lost_copies:  # with --replace: _inspect refuses it otherwise
        lost, first = replace_bookie(metadata, bookie_id, address, host=host,
                                     instance=fresh.instance)
        fresh = Cookie(bookie_id, fresh.instance, fresh.created_at, first_ledger=first)
    else:  # a new bookie, one that never held a copy, or one registered before cookies
        set_bookie_endpoint(metadata, bookie_id, address, host=host, writable=True,
                            instance=fresh.instance)
    _write_cookie(root, fresh)
    return fresh, lost


def check_identity(root: Path, bookie_id: str, metadata: MetadataStore, *,
                   replace: bool = False) -> Cookie | None:
    """What :func:`claim_identity` would do, writing nothing (checked before the bookie
    binds its port): the directory's cookie if it is this bookie's, None if a new one is
    to be made; ConfigError, naming the fix, if the bookie must not start."""
    return _inspect(root, bookie_id, metadata, replace)[0]


def _inspect(root: Path, bookie_id: str, metadata: MetadataStore, replace: bool
             ) -> tuple[Cookie | None, bool]:
    """(the directory's cookie if it is this bookie's, whether a registered instance of the
    bookie held copies that an empty directory lost); ConfigError where the table refuses."""
    cookie = read_cookie(root)
    known, instance = registered_instance(metadata, bookie_id)
    where = f"the bookie directory {str(root)!r}"
    if cookie is not None:
        if cookie.bookie_id != bookie_id:
            raise ConfigError(f"{where} is bookie {cookie.bookie_id!r}'s (instance "
                              f"{cookie.instance}), not {bookie_id!r}'s: start it as "
                              f"--bookie-id {cookie.bookie_id}, or give {bookie_id} its own "
                              "directory")
        if replace:
            raise ConfigError(f"--replace takes a lost bookie's place on an empty directory; "
                              f"{where} is bookie {bookie_id}'s own (instance "
                              f"{cookie.instance}): start it without --replace")
        if known and instance is not None and instance != cookie.instance:
            raise ConfigError(f"{where} holds instance {cookie.instance} of bookie "
                              f"{bookie_id}, but the metadata store knows {bookie_id} as "
                              f"instance {instance}: this is not its disk (an old copy, or "
                              "another store's); give its own directory, or an empty one "
                              "with --replace")
        if not known:
            raise ConfigError(f"{where} holds bookie {bookie_id} (instance {cookie.instance}) "
                              f"of another store: {metadata.backend.name} has no bookie "
                              f"{bookie_id}; give an empty directory")
        return cookie, False
    if _holds_ledgers(root) and (not known or instance is not None):
        raise ConfigError(f"{where} holds ledgers but no cookie ({COOKIE}): it is not the "
                          f"disk the metadata store knows as bookie {bookie_id}; give its "
                          "own directory, or an empty one (with --replace if its disk was "
                          "lost)")
    lost = instance is not None and bool(segments_with_bookie(metadata, bookie_id))
    if lost and not replace:
        raise ConfigError(
            f"{where} is empty, but bookie {bookie_id} (instance {instance}) held copies "
            "of segments: its disk was lost, or this is the wrong directory. If the disk "
            f"is lost, start with --replace: this one takes {bookie_id}'s place and the "
            "brokers copy what it held back onto it; else give its directory")
    return None, lost
