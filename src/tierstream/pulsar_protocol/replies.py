"""How the Pulsar listener answers: Pulsar's error code for a tierstream error, and the
request id a command carries."""

from __future__ import annotations

from typing import Any

from tierstream.errors import (
    AuthError,
    ConfigError,
    NotFoundError,
    NotOwnerError,
    ProducerBusyError,
    ProducerFencedError,
    StorageError,
    TierstreamError,
    UnavailableError,
)
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.names import InvalidTopicName
from tierstream.pulsar_protocol.schemas import SchemaRefused

__all__ = ["Refused", "error_code", "request_id", "send_error_code"]


class Refused(TierstreamError):
    """A request for a feature this listener does not offer (Pulsar's NotAllowedError)."""


def error_code(exc: BaseException) -> Any:  # an api.ServerError value
    if isinstance(exc, ProducerBusyError):
        return api.ProducerBusy
    if isinstance(exc, ProducerFencedError):
        return api.ProducerFenced
    if isinstance(exc, NotOwnerError):  # the client looks the topic up again
        return api.ServiceNotReady
    if isinstance(exc, SchemaRefused):
        return api.IncompatibleSchema
    if isinstance(exc, NotFoundError):
        return api.TopicNotFound
    if isinstance(exc, AuthError):
        return api.AuthorizationError
    if isinstance(exc, InvalidTopicName):
        return api.InvalidTopicName
    if isinstance(exc, (ConfigError, Refused)):
        return api.NotAllowedError
    return api.PersistenceError


def send_error_code(exc: BaseException) -> Any:
    """SEND_ERROR's code: the C++ core of most Pulsar clients fails the message it names only
    for ChecksumError; for any other code it drops the connection and sends the message again,
    forever. So a message refused for good (bad input, a refused feature, a key routed
    elsewhere) is answered ChecksumError, with the reason in the text; a store that cannot
    take it now (unavailable, out of space) PersistenceError, which the client retries."""
    if isinstance(exc, (UnavailableError, StorageError)):
        return api.PersistenceError
    return api.ChecksumError


def request_id(cmd: api.BaseCommand) -> int | None:
    for field, _ in cmd.ListFields():
        if field.name == "type":
            continue
        inner = getattr(cmd, field.name)
        if hasattr(inner, "request_id"):
            return int(inner.request_id)
    return None
