"""One rooted error tree for everything tierstream raises on purpose.

::

    TierstreamError                 the root: catch this to catch all of ours
    ├── ConfigError                 a bad option, argument, topic name, time or range
    ├── NotFoundError               a topic, segment, subscription or file that does not exist
    ├── AlreadyExistsError          creating something that is already there
    ├── ConflictError               an operation the object's state forbids (committing an
    │                               aborted transaction, writing to a committed one)
    │   └── StaleRoutingError       a batch routed by a partition count the topic no longer
    │                               has (it grew): the producer routes it again
    ├── DataLossError               data asked for is gone (retention) or was never durable
    ├── CorruptionError             every replica of an entry failed its checksum or id check
    ├── AuthError                   a missing or wrong token (never echoes the token)
    ├── UnavailableError            the broker (or another service) cannot be reached
    │   ├── FencedError             a broker that no longer serves the store, or a partition
    │   │   └── NotOwnerError       a partition another broker owns now
    │   └── AckInDoubtError         an ack resent across a broker outage was stored, but the
    │                               new broker may have delivered its messages again first
    ├── StorageError                the data directory cannot be used (not a directory,
    │                               read-only, out of space or file descriptors)
    └── ProtocolError               the two ends of a connection disagree about the wire format

Messages say which value was wrong and what would have been valid.
"""

from __future__ import annotations

__all__ = [
    "AckInDoubtError",
    "AlreadyExistsError",
    "AuthError",
    "ConfigError",
    "ConflictError",
    "CorruptionError",
    "DataLossError",
    "FencedError",
    "NotFoundError",
    "NotOwnerError",
    "ProducerBusyError",
    "ProducerFencedError",
    "ProtocolError",
    "StaleRoutingError",
    "StorageError",
    "TierstreamError",
    "UnavailableError",
]


class TierstreamError(Exception):
    """Root of every error tierstream raises on purpose."""

    #: a short, stable name used on the wire between broker and clients
    code = "error"


class ConfigError(TierstreamError, ValueError):
    """A value a user supplied is malformed or out of range."""

    code = "config"


class NotFoundError(TierstreamError, LookupError):
    """Something that was named does not exist."""

    code = "not_found"


class AlreadyExistsError(TierstreamError):
    """Something that was to be created is already there."""

    code = "already_exists"


class ConflictError(TierstreamError):
    """The operation conflicts with the state of what it names (a transaction that already
    ended, a batch staged for another sink)."""

    code = "conflict"


class StaleRoutingError(ConflictError):
    """A batch was routed by a partition count the topic no longer has: it grew at a scale
    event. Nothing of it was stored; the producer routes it by ``partitions`` and sends it
    again."""

    code = "stale_routing"

    def __init__(self, message: str, *, partitions: int | None = None) -> None:
        super().__init__(message)
        self.partitions = partitions


class ProducerBusyError(ConflictError):
    """A producer was refused because an exclusive producer holds (or waits for) the
    partition (Pulsar's ProducerBusy)."""

    code = "producer_busy"


class ProducerFencedError(ConflictError):
    """A producer was refused or stopped because another holds the partition exclusively,
    or took it over (Pulsar's ProducerFenced): it must not write there again."""

    code = "producer_fenced"


class DataLossError(TierstreamError):
    """Data that was asked for is no longer (or never was) available."""

    code = "data_loss"


class CorruptionError(TierstreamError):
    """Stored bytes failed their checksum or id check on every replica."""

    code = "corruption"


class AuthError(TierstreamError, PermissionError):
    """Authentication failed. The message never contains the token."""

    code = "auth"


class UnavailableError(TierstreamError, ConnectionError):
    """A service could not be reached."""

    code = "unavailable"


class FencedError(UnavailableError):
    """A write to a broker that is no longer the store's writer: another broker took the
    store over (a higher epoch) and fenced the ledgers this one had open. Nothing of it was
    stored; the client reconnects, to the broker that serves the store now."""

    code = "fenced"


class NotOwnerError(FencedError):
    """A write to a partition that this broker does not own (any more): another broker
    claimed it at a higher epoch (``metadata/ownership.py``). The message names the owner;
    nothing of the write was stored. ``owner_url`` is where the owner is reached (None: not
    known), as data a client follows."""

    code = "not_owner"

    def __init__(self, message: str, owner_url: str | None = None) -> None:
        super().__init__(message)
        self.owner_url = owner_url


class AckInDoubtError(UnavailableError):
    """An ack that the broker's crash made resend was stored, but before it arrived the
    restarted broker may have delivered some of its messages to another consumer (or that
    consumer acknowledged them): they may be processed twice. They are acknowledged now and
    not delivered again after this; ``messages`` says how many were in doubt."""

    code = "ack_in_doubt"

    def __init__(self, message: str, messages: int = 0) -> None:
        super().__init__(message)
        self.messages = messages


class StorageError(TierstreamError):
    """The store's files cannot be created, written or opened (an environment problem)."""

    code = "storage"


class ProtocolError(TierstreamError):
    """The two ends of a connection disagree about the wire format."""

    code = "protocol"


ERRORS_BY_CODE: dict[str, type[TierstreamError]] = {
    cls.code: cls
    for cls in (
        TierstreamError,
        ConfigError,
        NotFoundError,
        AlreadyExistsError,
        ConflictError,
        StaleRoutingError,
        ProducerBusyError,
        ProducerFencedError,
        FencedError,
        NotOwnerError,
        DataLossError,
        CorruptionError,
        AuthError,
        UnavailableError,
        AckInDoubtError,
        StorageError,
        ProtocolError,
    )
}
