"""A Pulsar consumer subscribed by a topic pattern (``client.subscribe(re.compile(...))``):
its client lists the namespace (GET_TOPICS_OF_NAMESPACE) and subscribes to every topic whose
name matches, partitioned or not; topics made later are found at its next look (every 60 s:
the Python client does not pass ``pattern_auto_discovery_period`` on, so that is not waited
for here)."""

from __future__ import annotations

import re

import pulsar

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..timing import scaled
from .helpers import client_of


def test_a_pattern_subscription_gets_every_matching_topic_and_no_other(
        pulsar_broker: BrokerProcess) -> None:
    with Admin(pulsar_broker.url) as admin:
        admin.create_topic("acme/web/clicks", 2)
        admin.create_topic("acme/web/views", 1)
        admin.create_topic("acme/web/audit", 1)
    client = client_of(pulsar_broker)
    try:
        consumer = client.subscribe(re.compile("persistent://acme/web/(clicks|views)"), "rx",
                                    consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        sent = set()
        for topic in ("clicks", "views", "audit"):
            producer = client.create_producer(f"persistent://acme/web/{topic}",
                                              batching_enabled=False)
            for i in range(4):
                producer.send(f"{topic}-{i}".encode(), partition_key=f"k{i}")
                sent.add((topic, f"{topic}-{i}"))
            producer.close()
        got = set()
        while len(got) < 8:
            msg = consumer.receive(timeout_millis=int(scaled(15) * 1000))
            got.add((re.sub(r"-partition-\d+$", "", msg.topic_name()).rsplit("/", 1)[1],
                     msg.data().decode()))
            consumer.acknowledge(msg)
        assert got == {s for s in sent if s[0] != "audit"}
        try:  # and nothing of the topic the pattern leaves out (a bounded look)
            extra = consumer.receive(timeout_millis=500)
            raise AssertionError(f"a message of {extra.topic_name()} was delivered")
        except pulsar.Timeout:
            pass
    finally:
        client.close()
