"""Every test that stands in for other hosts with network namespaces, in one file so that they
run one after another on one worker. They share the machine's one bridge (a lock each set of
hosts holds, ``tests/network_store.py``): in three files, started first as slow files are,
two workers waited at the lock for minutes doing nothing. The tests live in
``network_hosts.py`` (bookie and broker hosts cut off, killed, paused), ``lease_lapse.py``
(a cluster broker whose PostgreSQL packets are dropped) and ``metadata_silence.py`` (a broker
cut off from PostgreSQL past its outage limit)."""

from __future__ import annotations

import pytest

from .consumer_silence import (
    consumer_a_host,
    test_a_reader_cut_off_past_the_brokers_give_up_reads_on_when_its_host_is_back,
    test_what_a_consumer_cut_off_holds_goes_to_the_others_and_it_attaches_again_when_back,
)
from .lease_lapse import (
    test_a_broker_cut_off_from_postgresql_alone_lets_go_in_time_and_rejoins,
    test_a_lease_that_lapsed_and_was_renewed_before_a_takeover_serves_its_partitions_again,
)
from .metadata_silence import (
    broker_a_host,
    test_a_broker_cut_off_from_postgresql_goes_on_after_a_short_cut_and_stops_at_the_limit,
)
from .network_hosts import (
    hosts,
    test_a_bookie_host_cut_off_and_a_broker_host_lost_cost_no_acknowledged_message,
    test_the_sequence_of_host_faults_that_lost_acknowledged_messages_loses_nothing,
    test_three_brokers_on_three_hosts_lose_nothing_to_a_kill_a_pause_and_a_drain,
)

pytestmark = pytest.mark.slow  # minutes: the file starts first (tests/conftest.py)

__all__ = [
    "broker_a_host",
    "consumer_a_host",
    "hosts",
    "test_a_bookie_host_cut_off_and_a_broker_host_lost_cost_no_acknowledged_message",
    "test_a_broker_cut_off_from_postgresql_alone_lets_go_in_time_and_rejoins",
    "test_a_broker_cut_off_from_postgresql_goes_on_after_a_short_cut_and_stops_at_the_limit",
    "test_a_lease_that_lapsed_and_was_renewed_before_a_takeover_serves_its_partitions_again",
    "test_a_reader_cut_off_past_the_brokers_give_up_reads_on_when_its_host_is_back",
    "test_the_sequence_of_host_faults_that_lost_acknowledged_messages_loses_nothing",
    "test_three_brokers_on_three_hosts_lose_nothing_to_a_kill_a_pause_and_a_drain",
    "test_what_a_consumer_cut_off_holds_goes_to_the_others_and_it_attaches_again_when_back",
]
