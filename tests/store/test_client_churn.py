"""The broker never crashes on a client that goes away. ``make chaos`` runs the long churn
(``tests/store/client_churn.py --kills 1000``); the suite a short one and the case that
crashed it."""

from __future__ import annotations

import contextlib

import pyarrow.flight as flight
import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer
from tierstream.model.positions import Offset
from tierstream.wire.flight import encode

from .client_churn import run
from .helpers import wait_for

TOPIC = "acme/churn/exclusive"


def test_a_consumer_whose_client_left_while_it_attached_is_detached(broker: BrokerProcess
                                                                      ) -> None:
    """Regression: a consumer whose call ended before its first batch (here: the client's
    deadline passed while the broker attached it; in the field, a client killed then) stayed
    attached for good, with the call's freed context as its liveness check: the next consumer
    of the subscription asked it and the broker died of SIGSEGV (client churn), or found the
    exclusive subscription held by nobody. Deadlines from 1 ms up land before, during and
    after the attach."""
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    client = flight.FlightClient(str(broker.url))
    try:
        for n in range(60):
            subscription = f"s{n}"
            ticket = {"op": "consume", "topic": TOPIC, "partition": 0, "key_ranges": None,
                      "subscription": {"name": subscription, "type": "exclusive",
                                       "consumer": f"left-{n}", "permits": 10,
                                       "initial": {"kind": "earliest"}}}
            with contextlib.suppress(flight.FlightError):  # the deadline: the client left
                client.do_get(flight.Ticket(encode(ticket)),
                              flight.FlightCallOptions(timeout=0.001 * (1 + n % 20))
                              ).read_all()
            # the subscription is free again: a new exclusive consumer attaches
            with Consumer(TOPIC, subscription, broker=broker.url, initial=Offset.earliest()):
                pass
            assert broker.proc is not None and broker.proc.poll() is None, "".join(
                broker.fatal or broker.stderr_tail)
    finally:
        client.close()

    def no_consumer_left() -> bool:
        with Admin(broker.url) as admin:
            return not any(r["consumers"] for r in admin.subscriptions(TOPIC))
    wait_for(no_consumer_left, what="every consumer to be detached")
    assert not broker.fatal


@pytest.mark.slow
def test_clients_of_both_kinds_opening_closing_and_killed_never_crash_the_broker(tmp_path
                                                                                 ) -> None:
    outcome = run(tmp_path, kills=20, seed=7, max_live=6)  # make chaos: 1000
    assert outcome.ok, str(outcome)
    assert outcome.broker_restarts == 1
