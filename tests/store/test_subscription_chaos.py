"""The suite's short subscription chaos run; ``make chaos`` runs the long one
(``tests/store/subscription_chaos.py``)."""

from __future__ import annotations

import pytest

from .subscription_chaos import run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["key_shared", "shared"])
def test_consumers_that_join_leave_and_crash_beside_a_broker_kill_lose_and_repeat_nothing(
        tmp_path, free_port, mode: str) -> None:
    outcome = run(tmp_path, free_port, mode=mode, messages=100_000, rounds=1)
    assert outcome.ok, str(outcome)
    assert outcome.broker_kills == 1 and outcome.worker_kills == 1 and outcome.closes >= 1


def test_acks_in_flight_across_broker_kills_that_return_are_never_followed_by_a_redelivery(
        tmp_path, free_port) -> None:
    """Regression: an ack that a broker SIGKILL made resend returned normally, and the
    restarted broker had already sent its messages to another consumer. Three consumers ack
    small batches all the time while the broker is killed four times: every ack returns with
    nothing of it delivered again, or raises AckInDoubtError."""
    outcome = run(tmp_path, free_port, mode="key_shared", messages=60_000,
                  steps=["join", "broker", "broker", "broker", "broker"])
    assert outcome.ok, str(outcome)
    assert outcome.broker_kills == 4
