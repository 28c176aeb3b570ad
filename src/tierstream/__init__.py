"""tierstream: one source API for batch and stream over a tiered, Pulsar-shaped event log."""

from tierstream.errors import (
    AckInDoubtError,
    AlreadyExistsError,
    AuthError,
    ConfigError,
    ConflictError,
    CorruptionError,
    DataLossError,
    NotFoundError,
    ProtocolError,
    StorageError,
    TierstreamError,
    UnavailableError,
)
from tierstream.model.message_format import MESSAGE_SCHEMA, READ_SCHEMA, key_hash
from tierstream.model.names import TopicName
from tierstream.model.positions import KeyRange, Offset, Position
from tierstream.read_options import ReadOptions
from tierstream.runtime.local import latest_cut, plan, read, scan, tail
from tierstream.splits.split import ReaderKind, Split, StreamCut
from tierstream.util.version import VERSION

__version__ = VERSION

__all__ = [
    "MESSAGE_SCHEMA",
    "READ_SCHEMA",
    "AckInDoubtError",
    "AlreadyExistsError",
    "AuthError",
    "ConfigError",
    "ConflictError",
    "CorruptionError",
    "DataLossError",
    "KeyRange",
    "NotFoundError",
    "Offset",
    "Position",
    "ProtocolError",
    "ReadOptions",
    "ReaderKind",
    "Split",
    "StorageError",
    "StreamCut",
    "TierstreamError",
    "TopicName",
    "UnavailableError",
    "__version__",
    "key_hash",
    "latest_cut",
    "plan",
    "read",
    "scan",
    "tail",
]
