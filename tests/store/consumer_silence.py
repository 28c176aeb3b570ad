"""A consumer whose host is cut off (its network namespace's link down: every packet
dropped, no reset, no FIN), beside one that is not. Collected by ``test_network_namespaces.py``.

Regression: neither side noticed. The broker kept the silent consumer attached, holding
what it had been sent, unacknowledged, until the kernel gave its connection up (about 15
minutes with data in flight; never for an idle stream), so a shared subscription's other
consumers never got those messages; and a client that re-attached over a new connection
met its own old registration ("already has a consumer named ...") and died. Now a
consumer's client says it is there every ``keepalive``; the broker lets go of one silent
for twice that, and a client whose keepalive goes unanswered attaches again.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer

from ..network_store import Hosts, hosts_or_fail
from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/silence/work"
TOKEN = "consumer-silence-test-token"

#: consumer "a" (on the host cut off): prints each value it receives, acknowledges nothing
_HOLDER = """
import sys
from tierstream.client import Consumer
url, topic, keepalive = sys.argv[1], sys.argv[2], float(sys.argv[3])
with Consumer(topic, "work", mode="shared", consumer_name="a", receiver_queue_size=100,
              initial="earliest", keepalive=keepalive, broker=url) as c:
    while True:
        batch = c.receive(timeout=1)
        if batch is not None:
            for v in batch.column("value").to_pylist():
                print(bytes(v).decode(), flush=True)
"""


@pytest.fixture
def consumer_a_host() -> Any:
    # a second host keeps the bridge's carrier up when the first is cut off (with no port
    # up, the broker's own sends to it fail at once, as on no real network)
    with hosts_or_fail(["consumer-a", "bystander"]) as h:
        yield h


@pytest.mark.slow
def test_what_a_consumer_cut_off_holds_goes_to_the_others_and_it_attaches_again_when_back(
        tmp_path: Path, consumer_a_host: Hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTREAM_AUTH_TOKEN", TOKEN)  # off loopback, every call needs one
    keepalive = scaled(2)  # (let go after twice that)
    broker = BrokerProcess(tmp_path / "broker", host=consumer_a_host.gateway,
                           args=["--no-fsync"]).start(timeout=scaled(60))
    holder = None
    try:
        assert broker.url is not None
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 1)
        sent = [f"m{i}" for i in range(300)]
        with Producer(TOPIC, broker=broker.url) as producer:
            for i in range(0, 300, 10):  # entries of 10: shared hands out whole runs
                producer.send_many({"value": v} for v in sent[i:i + 10])
        holder = subprocess.Popen(
            ["ip", "netns", "exec", consumer_a_host.ns("consumer-a"), sys.executable, "-c",
             _HOLDER, broker.url, TOPIC, f"{keepalive:g}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        held: list[str] = []
        err: list[str] = []
        threading.Thread(target=lambda: held.extend(iter(holder.stdout.readline, "")),
                         daemon=True).start()
        threading.Thread(target=lambda: err.extend(iter(holder.stderr.readline, "")),
                         daemon=True).start()
        wait_for(lambda: len(held) >= 50, timeout=scaled(60),
                 what="consumer a, on the other host, to hold what it was sent")

        got: set[str] = set()
        with Consumer(TOPIC, "work", mode="shared", consumer_name="b",
                      initial="earliest", keepalive=keepalive, broker=broker.url) as b:
            def until(condition: Any) -> Any:
                def step() -> bool:  # consumer b receives and acknowledges as it waits
                    batch = b.receive(timeout=0.2)
                    if batch is not None:
                        got.update(bytes(v).decode() for v in batch.column("value").to_pylist())
                        b.ack(batch)
                    return bool(condition())
                return step

            wait_for(until(lambda: len(got) + len(held) >= len(sent)), timeout=scaled(60),
                     what="consumer b to get what a does not hold")
            # a holds them, nobody else has had them (all of them, unless load made a's
            # keepalive late once: it attached again, and some came again)
            assert {v.strip() for v in held} - got

            consumer_a_host.cut("consumer-a")
            wait_for(until(lambda: set(sent) <= got), timeout=scaled(30) + 4 * keepalive,
                     what="what the consumer cut off held to reach the other one")
            assert "was not heard from" in "".join(broker.stderr_tail)

            consumer_a_host.mend("consumer-a")
            with Admin(broker.url) as admin:
                wait_for(lambda: "a" in {c["name"] for s in admin.subscriptions(TOPIC)
                                         for c in s["consumers"]},
                         timeout=scaled(120), what="consumer a to attach again")
            assert holder.poll() is None, "".join(err)[-3000:]
            assert "already has a consumer" not in "".join(err)
    finally:
        if holder is not None:
            holder.kill()
        broker.kill()


#: a tail reader (on the host cut off): prints how many messages it has read
_TAIL = """
import sys, tierstream
n = 0
for batch in tierstream.tail(sys.argv[2], start="earliest", broker=sys.argv[1]):
    n += batch.num_rows
    print(n, flush=True)
"""


@pytest.mark.chaos  # (about 7 minutes: gRPC's keepalive interval is 5.5; make chaos runs it)
def test_a_reader_cut_off_past_the_brokers_give_up_reads_on_when_its_host_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a tail reader whose host was cut off for longer than the broker's kernel
    retransmits (``tcp_retries2``, 3 here: seconds, not the 15 minutes of the default) never
    read again: the broker had given the connection up, and a stream that only receives
    sends nothing that could find that out. Every client connection now pings while a call
    is under way (``wire/security.py``): the reader's unanswered ping closes it, and the
    reader reconnects from where it was."""
    from tierstream.wire.security import KEEPALIVE_OPTIONS

    monkeypatch.setenv("TIERSTREAM_AUTH_TOKEN", TOKEN)
    keepalive_s = dict(KEEPALIVE_OPTIONS)["grpc.keepalive_time_ms"] / 1000
    with hosts_or_fail(["reader", "broker", "bystander"]) as hosts:
        subprocess.run(["ip", "netns", "exec", hosts.ns("broker"), "sysctl", "-qw",
                        "net.ipv4.tcp_retries2=3"], check=True)
        broker = BrokerProcess(tmp_path / "broker", host=hosts.address("broker"), port=6651,
                               args=["--no-fsync"],
                               prefix=["ip", "netns", "exec", hosts.ns("broker")])
        reader = None
        try:
            broker.start(timeout=scaled(60))
            assert broker.url is not None
            with Admin(broker.url) as admin:
                admin.create_topic(TOPIC, 1)

            def send(tag: str, n: int) -> None:
                with Producer(TOPIC, broker=broker.url) as producer:
                    producer.send_many({"value": f"{tag}{i}"} for i in range(n))

            send("a", 100)
            reader = subprocess.Popen(
                ["ip", "netns", "exec", hosts.ns("reader"), sys.executable, "-c", _TAIL,
                 broker.url, TOPIC], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True)
            read: list[str] = []
            threading.Thread(target=lambda: read.extend(iter(reader.stdout.readline, "")),
                             daemon=True).start()

            def count() -> int:
                return max([int(line) for line in read if line.strip().isdigit()], default=0)

            wait_for(lambda: count() == 100, timeout=scaled(60), what="the first 100")
            hosts.cut("reader")
            for k in range(20):  # sent into the silence: the broker retransmits, gives up
                send(f"c{k}-", 10)
            time.sleep(scaled(20))  # past the broker's give-up (a few seconds)
            hosts.mend("reader")
            send("b", 100)
            wait_for(lambda: count() == 400, timeout=keepalive_s + scaled(120),
                     what="the reader to read on after its host came back")
        finally:
            if reader is not None:
                reader.kill()
            broker.kill()
