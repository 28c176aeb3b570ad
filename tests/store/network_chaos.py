"""``python -m tests.store.network_chaos [--faults N]``: the long version of
``test_network_hosts.py`` (``make chaos``): a store on five network namespaces (three bookie
hosts, two broker hosts, PostgreSQL on the bridge) under a named producer, with N faults
drawn at random: a bookie SIGKILLed and restarted, a bookie host cut off and mended, the
serving broker SIGKILLed and the other host's broker started. After each fault the producer
must get more acknowledgements; at the end every acknowledged message is read once, in
per-key order, through the broker.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..network_store import BookieProcess, Hosts, broker_args, network_namespaces_unavailable
from ..postgres import PostgresServer
from ..timing import scaled
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order

BOOKIE_PORT, BROKER_PORT, TOKEN = 3181, 6651, "network-chaos-token"


def run(faults: int, seed: int) -> dict[str, Any]:
    why = network_namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"network chaos needs network namespaces: {why}")
    os.environ["TIERSTREAM_AUTH_TOKEN"] = TOKEN
    rng = random.Random(seed)
    counts = {"bookie-kill": 0, "bookie-cut": 0, "broker-kill": 0}
    started = time.monotonic()
    names = ["bookie-0", "bookie-1", "bookie-2", "broker-a", "broker-b"]
    with Hosts(names) as hosts, tempfile.TemporaryDirectory() as tmp:
        server = PostgresServer(also_on=hosts.gateway)
        procs: list[Any] = []
        try:
            url = server.new_database().replace("127.0.0.1", hosts.gateway)
            bookies = [BookieProcess(Path(tmp) / f"bookie-{i}", url, host_label=f"bookie-{i}",
                                     bind=hosts.address(f"bookie-{i}"), port=BOOKIE_PORT,
                                     netns=hosts.ns(f"bookie-{i}")).start() for i in range(3)]
            procs += bookies
            run_no = [0]

            def broker(name: str) -> BrokerProcess:
                run_no[0] += 1
                proc = BrokerProcess(Path(tmp) / f"{name}-{run_no[0]}", host=hosts.address(name),
                                     port=BROKER_PORT, args=broker_args(url),
                                     prefix=["ip", "netns", "exec", hosts.ns(name)])
                procs.append(proc)
                began = time.monotonic()
                proc.start(timeout=scaled(120))
                print(f"broker on {name} serving after {time.monotonic() - began:.1f} s",
                      flush=True)
                return proc

            serving, spare = "broker-a", "broker-b"
            current = broker(serving)
            with Admin(current.url) as admin:
                admin.create_topic(TOPIC, 2)
            addresses = ",".join(f"grpc://{hosts.address(n)}:{BROKER_PORT}"
                                 for n in ("broker-a", "broker-b"))
            writer = _Writer(addresses)
            faults_done = [0]
            try:
                writer.wait_for_more(500)
                for n in range(faults):
                    kind = rng.choice(list(counts))
                    counts[kind] += 1
                    if kind == "bookie-kill":
                        victim = rng.choice(bookies)
                        victim.kill()
                        writer.wait_for_more(300)
                        victim.restart()
                    elif kind == "bookie-cut":
                        name = f"bookie-{rng.randrange(3)}"
                        hosts.cut(name)
                        writer.wait_for_more(300)
                        hosts.mend(name)
                    else:
                        current.kill()
                        serving, spare = spare, serving
                        current = broker(serving)
                    writer.wait_for_more(300)
                    print(f"fault {n + 1}/{faults}: {kind}; {writer.acked:,} acknowledged",
                          flush=True)
                    faults_done[0] = n + 1
            finally:
                try:
                    acked = writer.stop()
                except AssertionError:
                    print("serving broker said:", "".join(list(current.stderr_tail)[-30:]))
                    raise
            values = _read(f"grpc://{hosts.address(serving)}:{BROKER_PORT}")
            check_exactly_once_in_order(values, acked)
        finally:
            for proc in procs:
                proc.kill()
            server.stop()
    return {"faults": faults, **counts, "acknowledged": acked, "read": len(values),
            "seconds": round(time.monotonic() - started)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.store.network_chaos")
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=20261126)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    outcome = run(args.faults, args.seed)
    print(f"network chaos passed: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
