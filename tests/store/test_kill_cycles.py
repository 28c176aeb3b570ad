"""The suite's short kill-cycle run; ``make chaos`` runs the long one (``tests/store/chaos.py``)."""

from __future__ import annotations

import pytest

from .chaos import CONFIGS, run_cycles


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_twelve_kill_cycles_under_three_named_producers_lose_and_duplicate_nothing(
        tmp_path, config) -> None:
    # 12 per configuration keeps the suite near its 12 minutes; make chaos runs 100
    outcome = run_cycles(tmp_path, config=config, cycles=12, seed=20261122, extra_uptime=0.8)
    assert outcome.cycles == 12, outcome.line()  # every cycle killed a live broker
    assert outcome.report.ok, f"{outcome.line()}\n{outcome.report}"
    assert outcome.report.acknowledged > 1000, outcome.line()


@pytest.mark.slow
def test_kill_cycles_with_postgresql_metadata_lose_and_duplicate_nothing(tmp_path,
                                                                        postgres) -> None:
    # the representative PostgreSQL run; make chaos runs 100 cycles of each configuration
    outcome = run_cycles(tmp_path, config="3-bookies-wq3-aq2", cycles=4, seed=20261126,
                         extra_uptime=0.8, metadata=postgres.new_database())
    assert outcome.cycles == 4, outcome.line()
    assert outcome.report.ok, f"{outcome.line()}\n{outcome.report}"
