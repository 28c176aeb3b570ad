"""The suite's short chaos run with the real Pulsar client: a Pulsar producer writes keyed
messages while Pulsar Key_Shared and Shared consumers (processes) join, close and are
SIGKILLed and the broker is SIGKILLed; ``make chaos`` runs the long one
(``python -m tests.store.subscription_chaos --client pulsar``). The Key_Shared run's producer
is an application's, unchanged: its keys routed by the client's own hash."""

from __future__ import annotations

import pytest

from ..store.subscription_chaos import run


@pytest.mark.parametrize(("mode", "routing"), [("key_shared", "client"),
                                               ("shared", "tierstream")])
def test_pulsar_consumers_that_join_leave_and_crash_beside_a_broker_kill_lose_nothing(
        tmp_path, free_port, mode: str, routing: str) -> None:
    outcome = run(tmp_path, free_port, mode=mode, messages=20_000, rounds=1, client="pulsar",
                  routing=routing)
    assert outcome.ok, str(outcome)
    assert outcome.broker_kills == 1 and outcome.worker_kills == 1 and outcome.closes >= 1
