"""Errors survive the network: each tierstream error crosses Flight as the same class."""

from __future__ import annotations

import re

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

from ..timing import scaled


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


@pytest.mark.parametrize("shape", ["whole-entries", "random", "one", "none"])
def test_ack_positions_cross_the_wire_as_runs_and_come_back_whole(shape: str) -> None:
    """An ack names its messages as runs of consecutive indexes of an entry: a batch of whole
    entries is one run each, any other set of positions comes back as it was, in order; a
    body of the three arrays whole (an older client's) is read too."""
    import base64

    import numpy as np
    import pyarrow as pa

    from tierstream.wire.flight import decode_positions, encode_positions

    rng = np.random.default_rng(3)
    n = {"whole-entries": 3000, "random": 500, "one": 1, "none": 0}[shape]
    if shape == "whole-entries":
        segment, entry = np.full(n, 7), np.repeat([4, 5, 9], 1000)
        index = np.tile(np.arange(1000), 3)
    else:
        segment, entry = np.sort(rng.integers(0, 3, n)), rng.integers(0, 3, n)
        index = rng.integers(0, 4, n)
    batch = pa.record_batch({"segment_id": segment, "entry_id": entry, "batch_index": index})
    body = encode_positions(batch)
    for got, sent in zip(decode_positions(body), (segment, entry, index), strict=True):
        assert got.tolist() == sent.tolist()
    if shape == "whole-entries":
        assert len(base64.b64decode(body["runs"])) == 3 * 4 * 8  # three runs
    older = {name: base64.b64encode(np.asarray(col, "<i8").tobytes()).decode()
             for name, col in (("segment_id", segment), ("entry_id", entry),
                               ("batch_index", index))}
    assert [a.tolist() for a in decode_positions(older)] == [
        segment.tolist(), entry.tolist(), index.tolist()]
    with pytest.raises(ProtocolError, match="malformed positions"):
        decode_positions({"runs": base64.b64encode(np.arange(3, dtype="<i8")).decode()})


_SUB = {"op": "consume", "topic": "a/b/c", "partition": 0}


@pytest.mark.parametrize(("ticket", "error", "says"), [
    ({"op": "read"}, ProtocolError, "unknown DoGet operation 'read'"),
    ({"op": "consume", "topic": "a/b/c"}, ProtocolError,
     "malformed consume request: KeyError('partition')"),
    ({**_SUB, "partition": "one"}, ProtocolError, "malformed consume request: ValueError"),
    ({**_SUB, "subscription": "s"}, ProtocolError, "malformed consume request"),
    ({**_SUB, "subscription": {"name": "s", "permits": "many"}}, ProtocolError,
     "malformed consume request: ValueError"),
    ({**_SUB, "subscription": {"name": "s", "max_redeliveries": -1}}, ConfigError,
     "max_redeliveries must be 0 or more, not -1"),
], ids=["op", "no-partition", "partition", "subscription", "permits", "max-redeliveries"])
def test_a_consume_ticket_that_does_not_convert_is_refused_naming_what(
        broker, ticket, error, says) -> None:
    """Any Flight client may send a ticket; one that does not convert is refused before
    anything is attached, naming the field. A negative ``max_redeliveries`` was taken and
    sent every message to the dead letters on its first delivery."""
    import pyarrow.flight as flight

    from tierstream.wire.flight import encode

    with Admin(broker.url) as admin:
        admin.create_topic("a/b/c", 1)
    raw = flight.connect(broker.url)
    try:
        with pytest.raises(error, match=re.escape(says)), translate_errors(broker.url):
            # (the old broker took a negative max_redeliveries and served the stream on)
            raw.do_get(flight.Ticket(encode(ticket)),
                       flight.FlightCallOptions(timeout=scaled(10))).read_all()
    finally:
        raw.close()
