"""The suite's short chaos run with the real Pulsar client: a Pulsar producer writes keyed
messages while Pulsar Key_Shared and Shared consumers (processes) join, close and are
SIGKILLed and the broker is SIGKILLed; ``make chaos`` runs the long one
(``python -m tests.store.subscription_chaos --client pulsar``)."""

from __future__ import annotations

import pytest

from ..store.subscription_chaos import run


@pytest.mark.parametrize("mode", ["key_shared", "shared"])
def test_pulsar_consumers_that_join_leave_and_crash_beside_a_broker_kill_lose_nothing(
        tmp_path, free_port, mode: str) -> None:
    outcome = run(tmp_path, free_port, mode=mode, messages=20_000, rounds=1, client="pulsar")
    assert outcome.ok, str(outcome)
    assert outcome.broker_kills == 1 and outcome.worker_kills == 1 and outcome.closes >= 1
