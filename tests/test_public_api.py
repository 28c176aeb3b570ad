"""The public API: the names the package root exports, pinned."""

from __future__ import annotations

import tierstream


def test_public_names_are_pinned() -> None:
    assert sorted(tierstream.__all__) == sorted([
        "MESSAGE_SCHEMA", "READ_SCHEMA", "AlreadyExistsError", "AuthError", "ConfigError",
        "CorruptionError", "DataLossError", "KeyRange", "NotFoundError", "Offset", "Position",
        "ProtocolError", "ReaderKind", "Split", "StorageError", "StreamCut", "TierstreamError",
        "TopicName", "UnavailableError", "__version__", "key_hash", "latest_cut", "plan", "read",
        "scan", "tail",
    ])
    for name in tierstream.__all__:
        assert hasattr(tierstream, name)
