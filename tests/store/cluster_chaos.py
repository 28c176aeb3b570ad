"""``python -m tests.store.cluster_chaos [--faults N]``: several brokers serving one store
(``broker start --cluster``) on six network namespaces (three broker hosts, three bookie
hosts, PostgreSQL on the bridge), a 12-partition topic spread over the brokers under a named
producer and a key_shared consumer, each given every broker, another under the real
pulsar-client's (``pulsar_traffic.py``, a multi-host service URL: LOOKUP finds each
partition's owner), a transactional writer (``txn_traffic.py``: each transaction over
every partition of its topic, committed as a sink's numbered batch), and N faults drawn at
random, one after another:

- ``broker-kill``: a broker SIGKILLed; the others take its partitions over once its lease
  expired; then it is started again (a new broker, owning nothing);
- ``broker-hang``: a broker SIGSTOPped past its lease, its partitions taken over; continued,
  it finds its lease lapsed, lets go (a zombie: nothing it still had in hand is stored) and
  rejoins owning nothing; stopped, and started again;
- ``broker-cut``: a broker's host cut off past its lease, its partitions taken over; mended,
  it rejoins as the hung one does (or, cut off past the metadata outage limit, stops);
  stopped, and started again;
- ``broker-drain``: every partition of a broker moved to the others (``broker drain``);
- ``topic-unload``: one partition moved to the least-loaded other broker (``topic unload``);
- ``bookie-kill``, ``bookie-cut``, ``bookie-wipe`` (a bookie back on an empty disk with
  ``--replace``, once earlier faults are repaired) and ``postgres-restart``, as in
  ``network_chaos.py``;
- ``postgres-outage``: PostgreSQL away for two leases, for every broker at once: none may
  stop (none can take a partition over without it).

After each fault both producers must get more acknowledgements and a transaction must
commit. At the end every acknowledged message is read once, in per-key order, the consumers
received every one, every key in order, and every committed batch's rows are read once.
``--sequence`` replays a fixed list instead (the suite's short version,
``network_hosts.py``).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..network_store import Hosts, broker_args
from ..postgres import PostgresServer
from ..timing import scaled
from .helpers import stop_process, wait_for
from .network_chaos import (
    TOKEN,
    _check_disks,
    chaos_main,
    fault_plan,
    start_bookies,
    store_fault,
    with_token,
)
from .pulsar_traffic import PULSAR_TOPIC, PulsarTraffic
from .test_cluster import _Received
from .test_network_bookies import (
    TOPIC,
    _read,
    _values,
    _Writer,
    check_exactly_once_in_order,
)
from .txn_traffic import TXN_TOPIC, TxnWriter

BROKER_PORT, PULSAR_PORT, PARTITIONS = 6651, 6650, 12
LEASE_S = scaled(3)
BROKERS = ("broker-a", "broker-b", "broker-c")
KINDS = ("broker-kill", "broker-hang", "broker-cut", "broker-drain", "topic-unload",
         "bookie-kill", "bookie-cut", "bookie-wipe", "postgres-restart", "postgres-outage")


def run(faults: int, seed: int, sequence: list[str] | None = None, *, between: int = 300,
        spark: Any = None, transactions: bool = True) -> dict[str, Any]:
    """``faults`` drawn at random (or ``sequence``), ``between`` more acknowledgements after
    each; ``spark``: a session that reads the topic back too; ``transactions``: with the
    transactional writer. The token is set for the run only (``network_chaos.run`` says
    why)."""
    return with_token(lambda: _run(faults, seed, sequence, between, spark, transactions))


class _Brokers:
    """The three cluster brokers, one per host, each started again after a fault that
    stopped it."""

    def __init__(self, hosts: Hosts, tmp: Path, metadata: str, procs: list[Any]) -> None:
        self.hosts, self.tmp, self.metadata, self.procs = hosts, tmp, metadata, procs
        self.running: dict[str, BrokerProcess] = {}
        self.starts = 0

    def url(self, name: str) -> str:
        return f"grpc://{self.hosts.address(name)}:{BROKER_PORT}"

    def start(self, name: str) -> BrokerProcess:
        self.starts += 1
        proc = BrokerProcess(self.tmp / f"{name}-{self.starts}", host=self.hosts.address(name),
                             port=BROKER_PORT,
                             args=broker_args(self.metadata, "--cluster", "--lease-timeout",
                                              f"{LEASE_S:g}s", "--pulsar-port",
                                              str(PULSAR_PORT)),
                             prefix=["ip", "netns", "exec", self.hosts.ns(name)])
        self.procs.append(proc)
        self.running[name] = proc.start(timeout=scaled(180))
        return proc

    def broker_id(self, name: str) -> str:
        with Admin(self.url(name)) as admin:
            return str(admin.stats()["broker"]["id"])

    def most_loaded(self) -> str:
        """The running broker owning the most partitions (the first named on a tie): a
        broker fault there moves the most."""
        with Admin(self.url(next(iter(self.running)))) as admin:
            rows = admin.stats()["brokers"]
        ids = {name: self.broker_id(name) for name in self.running}
        load = {name: sum(int(r["partitions"]) for r in rows if r["broker"] == ids[name])
                for name in ids}
        return max(sorted(load), key=lambda name: load[name])

    def taken_over(self, victim: str, broker_id: str) -> None:
        """Wait until ``broker_id``'s lease is over, as the others see it, and they own
        every partition it owned."""
        asking = next(n for n in BROKERS if n != victim)

        def over() -> bool:
            with Admin(self.url(asking)) as admin:
                row = [r for r in admin.stats()["brokers"] if r["broker"] == broker_id]
            return not row or (int(row[0]["partitions"]) == 0 and
                               (row[0]["heard_ms_ago"] or 0) > LEASE_S * 1000)

        wait_for(over, timeout=scaled(120), what=f"{victim}'s lease to end, its partitions "
                 "taken over")

    def say(self) -> None:
        """What the brokers said last (a failed run)."""
        for proc in self.procs:
            if isinstance(proc, BrokerProcess):
                print(f"{proc.data_dir.name} said:", "".join(list(proc.stderr_tail)[-40:]))

    def all_running(self) -> None:
        """No broker stopped but those a fault stopped: a fault elsewhere (a bookie's disk
        replaced, a partition moved) must not stop one."""
        for name, proc in self.running.items():
            assert proc.proc is not None
            assert proc.proc.poll() is None, \
                f"{name} stopped: {''.join(list(proc.stderr_tail)[-20:])}"

    def stopped_by_itself(self, name: str) -> None:
        """A broker whose lease was lost, given back its CPU or its network, lets its
        partitions go saying why and rejoins owning nothing (or, cut off past the metadata
        store's outage limit, stops saying why, not with exit 0); then it is stopped, for
        a fresh one to take its place."""
        proc = self.running.pop(name)
        assert proc.proc is not None
        wait_for(lambda: "renews its lease again" in "".join(proc.stderr_tail)
                 or proc.proc.poll() is not None, timeout=scaled(120),
                 what=f"{name}, whose lease was lost, to rejoin or stop")
        said = "".join(proc.stderr_tail)
        code = proc.proc.poll()
        assert code != 0, f"{name}, whose lease was lost, exited 0"
        assert "lease" in said or "fenced" in said, said[-2000:]
        assert proc.tracebacks == [], proc.tracebacks
        proc.kill()


def _run(faults: int, seed: int, sequence: list[str] | None, between: int, spark: Any,
         transactions: bool) -> dict[str, Any]:
    rng, plan = fault_plan("cluster chaos", KINDS, faults, seed, sequence)
    counts = dict.fromkeys(KINDS, 0)
    started = time.monotonic()
    names = ["bookie-0", "bookie-1", "bookie-2", *BROKERS]
    with Hosts(names) as hosts, tempfile.TemporaryDirectory() as tmp:
        server = PostgresServer(also_on=hosts.gateway)
        procs: list[Any] = []
        try:
            url = server.new_database().replace("127.0.0.1", hosts.gateway)
            bookies = start_bookies(hosts, Path(tmp), url)
            procs += bookies
            brokers = _Brokers(hosts, Path(tmp), url, procs)
            for name in BROKERS:
                brokers.start(name)
            with Admin(brokers.url("broker-a")) as admin:
                admin.create_topic(TOPIC, PARTITIONS)
                admin.create_topic(PULSAR_TOPIC, PARTITIONS)
                admin.create_topic(TXN_TOPIC, len(BROKERS))
            every = ",".join(brokers.url(n) for n in BROKERS)
            # longer than a move after a failure (lease, recovery, reconnect)
            writer = _Writer(every, send_timeout=scaled(12))
            received = _Received(every)
            txns = TxnWriter(every) if transactions else None
            # a Pulsar application, given every broker in a multi-host service URL
            app = PulsarTraffic("pulsar://" + ",".join(
                f"{hosts.address(n)}:{PULSAR_PORT}" for n in BROKERS), TOKEN,
                send_timeout=scaled(60))
            procs.append(app)

            def listed() -> int:  # by every broker: each one audits
                total = 0
                for name in brokers.running:
                    with Admin(brokers.url(name)) as admin:
                        total += int(admin.stats()["replication"]["under_replicated"])
                return total

            def repaired(what: str) -> float:
                began = time.monotonic()
                wait_for(lambda: listed() == 0, timeout=scaled(300), what=what)
                return time.monotonic() - began

            try:
                writer.wait_for_more(500)
                for n, kind in enumerate(plan):
                    counts[kind] += 1
                    victim = brokers.most_loaded() if "broker" in kind else rng.choice(BROKERS)
                    if kind in ("broker-kill", "broker-hang", "broker-cut"):
                        proc, victim_id = brokers.running[victim], brokers.broker_id(victim)
                        assert proc.proc is not None
                        if kind == "broker-kill":
                            proc.kill()
                            brokers.running.pop(victim)
                        elif kind == "broker-hang":
                            stop_process(proc.proc.pid)
                        else:
                            hosts.cut(victim)
                        brokers.taken_over(victim, victim_id)
                        writer.wait_for_more(between)
                        if kind == "broker-hang":
                            proc.proc.send_signal(signal.SIGCONT)
                            brokers.stopped_by_itself(victim)
                        elif kind == "broker-cut":
                            hosts.mend(victim)
                            brokers.stopped_by_itself(victim)
                        brokers.start(victim)
                    elif kind == "broker-drain":
                        with Admin(brokers.url(victim)) as admin:
                            admin.drain()
                    elif kind == "postgres-outage":  # past the lease, for every broker
                        server.halt()
                        time.sleep(2 * LEASE_S)  # the fault is its length
                        brokers.all_running()
                        server.resume()
                    elif kind == "topic-unload":
                        with Admin(brokers.url(victim)) as admin:
                            admin.unload(TOPIC, rng.randrange(PARTITIONS))
                    else:
                        store_fault(kind, rng, bookies, hosts, server, writer, between,
                                    repaired)
                    writer.wait_for_more(between)
                    app.wait_for_more(between // 4)
                    if txns is not None:
                        txns.wait_for_more(1)
                    brokers.all_running()
                    print(f"fault {n + 1}/{len(plan)}: {kind} ({victim if 'broker' in kind else ''}"
                          f"); {writer.acked:,} acknowledged, {app.acked:,} to the Pulsar "
                          "client", flush=True)
            finally:
                acked = writer.stop()
                app_acked = app.stop_producing()
                txn_rows = 0 if txns is None else txns.stop()
            received.check(acked)
            if txns is not None:
                txns.check(txn_rows)
            app.check(app_acked)
            repaired("every segment to be whole again at the end")
            _check_disks(brokers.url("broker-a"), bookies)
            values = _read(brokers.url("broker-b"))
            check_exactly_once_in_order(values, acked)
            app_values = _values(tierstream.read(PULSAR_TOPIC, broker=brokers.url("broker-c")))
            check_exactly_once_in_order(app_values, app_acked)
            if spark is not None:
                from tierstream.spark_adapter.source import register

                register(spark)
                frame = spark.read.format("tierstream").options(
                    topic=TOPIC, broker=brokers.url("broker-c"), authToken=TOKEN).load()
                got = sorted(bytes(r.value).decode() for r in frame.select("value").collect())
                assert got == sorted(values), \
                    f"Spark read {len(got)} rows, tierstream.read {len(values)}"
            for name, proc in brokers.running.items():
                assert proc.tracebacks == [], (name, proc.tracebacks)
        except BaseException:
            if "brokers" in locals():
                brokers.say()
            raise
        finally:
            for proc in reversed(procs):  # the clients before the brokers they use
                proc.kill()
            server.stop()
    return {"faults": len(plan), **counts, "acknowledged": acked, "read": len(values),
            "received": len(set(received.values)), "pulsar_acknowledged": app_acked,
            "pulsar_read": len(app_values), "pulsar_received": len(set(app.values)),
            "transactions": txns and txns.committed,
            "transactions_written_again": txns and txns.failures,
            "seconds": round(time.monotonic() - started)}


def main(argv: list[str] | None = None) -> int:
    return chaos_main("cluster chaos", "python -m tests.store.cluster_chaos", KINDS, 20261128,
                      run, argv)


if __name__ == "__main__":
    sys.exit(main())
