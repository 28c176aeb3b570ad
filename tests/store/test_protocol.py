"""Errors survive the network: each tierstream error crosses Flight as the same class."""

from __future__ import annotations

import pytest

from tierstream.client import Admin
from tierstream.errors import (
    ERRORS_BY_CODE,
    AlreadyExistsError,
    AuthError,
    ConfigError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
    UnavailableError,
)
from tierstream.wire.flight import server_error, translate_errors


@pytest.mark.parametrize("cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code),
                         ids=lambda c: c.__name__)
def test_every_error_class_round_trips_through_the_flight_codec(cls) -> None:
    sent = cls(f"something about {cls.__name__}: 'value'")
    with pytest.raises(TierstreamError) as got, translate_errors("grpc://127.0.0.1:1"):
        raise server_error(sent)
    assert type(got.value) is cls
    assert "'value'" in str(got.value) or cls is AuthError  # auth never echoes the details


def test_errors_from_a_real_broker_come_back_as_their_class(broker) -> None:
    with Admin(broker.url) as admin:
        with pytest.raises(NotFoundError, match="'a/b/missing' does not exist"):
            admin.get_topic("a/b/missing")
        admin.create_topic("a/b/c", 1)
        with pytest.raises(AlreadyExistsError, match="'a/b/c' already exists"):
            admin.create_topic("a/b/c", 1)
        with pytest.raises(ProtocolError, match="unknown action 'no-such-action'"):
            admin.action("no-such-action")
        with pytest.raises(ConfigError, match="at most 1024 per topic"):
            admin.create_topic("a/b/big", 5000)
    with pytest.raises(UnavailableError, match="cannot reach the broker"), \
            Admin("grpc://127.0.0.1:1") as nobody:
        nobody.ping()
