"""``python -m tests.store.network_chaos [--faults N]``: the long version of
``network_hosts.py`` (``make chaos``): a store on five network namespaces (three bookie
hosts, two broker hosts, PostgreSQL on the bridge) under a named producer, with N faults
drawn at random:

- ``bookie-kill``: a bookie SIGKILLed and restarted;
- ``bookie-cut``: a bookie host cut off and mended;
- ``bookie-wipe``: a bookie SIGKILLed, its disk lost, and started on an empty one with
  ``--replace`` (first the broker must have re-replicated what earlier faults left short:
  the time between faults is at least the repair time, which is measured and printed);
- ``broker-kill``: the serving broker SIGKILLed and a broker started on the other host;
- ``broker-hang``: the serving broker SIGSTOPped, a standby on the other host takes over,
  and the old one, continued, finds itself fenced and stops;
- ``postgres-restart``: PostgreSQL stopped for a moment and started again.

After each fault the producer must get more acknowledgements; at the end every acknowledged
message is read once, in per-key order, through the broker, and the broker's replication
stats match the bookies' disks: nothing listed, every closed segment whole on each bookie of
its ensemble. ``--sequence`` replays a fixed list of faults instead (issue 47's:
``bookie-cut,broker-hang,bookie-wipe,bookie-wipe``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from ..network_store import BookieProcess, Hosts, broker_args, network_namespaces_unavailable
from ..postgres import PostgresServer
from ..timing import scaled
from .helpers import wait_for
from .test_network_bookies import TOPIC, _read, _Writer, check_exactly_once_in_order

BOOKIE_PORT, BROKER_PORT, TOKEN = 3181, 6651, "network-chaos-token"


T = TypeVar("T")

KINDS = ("bookie-kill", "bookie-cut", "bookie-wipe", "broker-kill", "broker-hang",
         "postgres-restart")


def run(faults: int, seed: int, sequence: list[str] | None = None, *,
        between: int = 300) -> dict[str, Any]:
    """``faults`` drawn at random (or ``sequence``), ``between`` more acknowledgements after
    each. The processes and this one's clients use a token (off loopback every endpoint
    needs one), set in the environment for the run only: a test worker that runs this goes
    on to start brokers that must not inherit it."""
    return with_token(lambda: _run(faults, seed, sequence, between))


def with_token(work: Callable[[], T]) -> T:
    """``work()`` with the chaos runs' token in the environment, for its length only."""
    previous = os.environ.get("TIERSTREAM_AUTH_TOKEN")
    os.environ["TIERSTREAM_AUTH_TOKEN"] = TOKEN
    try:
        return work()
    finally:
        if previous is None:
            os.environ.pop("TIERSTREAM_AUTH_TOKEN", None)
        else:
            os.environ["TIERSTREAM_AUTH_TOKEN"] = previous


def fault_plan(what: str, kinds: Sequence[str], faults: int, seed: int,
               sequence: list[str] | None) -> tuple[random.Random, list[str]]:
    """(the run's random source, its faults): ``sequence``, or ``faults`` drawn from
    ``kinds``. SystemExit, saying why, where network namespaces cannot be had or a fault
    of ``sequence`` is unknown."""
    why = network_namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"{what} needs network namespaces: {why}")
    for kind in sequence or []:
        if kind not in kinds:
            raise SystemExit(f"unknown fault {kind!r}: expected one of {', '.join(kinds)}")
    rng = random.Random(seed)
    return rng, list(sequence) if sequence is not None else [rng.choice(kinds)
                                                             for _ in range(faults)]


def start_bookies(hosts: Hosts, tmp: Path, url: str) -> list[BookieProcess]:
    """Three network bookies, one on each of the hosts ``bookie-0`` .. ``bookie-2``."""
    return [BookieProcess(tmp / f"bookie-{i}", url, host_label=f"bookie-{i}",
                          bind=hosts.address(f"bookie-{i}"), port=BOOKIE_PORT,
                          netns=hosts.ns(f"bookie-{i}")).start() for i in range(3)]


def store_fault(kind: str, rng: random.Random, bookies: list[BookieProcess], hosts: Hosts,
                server: PostgresServer, writer: _Writer, between: int,
                repaired: Callable[[str], float]) -> float | None:
    """A fault of the store's other hosts: ``bookie-kill``, ``bookie-cut``, ``bookie-wipe``
    (returns how long the lost disk's copies took to be whole again) or
    ``postgres-restart``; ``between`` more acknowledgements while it lasts."""
    if kind == "bookie-kill":
        victim = rng.choice(bookies)
        victim.kill()
        writer.wait_for_more(between)
        victim.restart()
    elif kind == "bookie-cut":
        name = f"bookie-{rng.randrange(3)}"
        hosts.cut(name)
        # cut off past --bookie-timeout (a bookie of the open segments is then taken for
        # gone; one of none is not noticed), writes go on
        cut_until = time.monotonic() + scaled(3) + 2
        writer.wait_for_more(between)
        time.sleep(max(0.0, cut_until - time.monotonic()))  # the fault's length
        writer.wait_for_more(between)
        hosts.mend(name)
    elif kind == "bookie-wipe":
        # the time between faults is at least the repair time
        waited = repaired("what earlier faults left short to be repaired")
        victim = rng.choice(bookies)
        victim.wipe()
        victim.start("--replace")
        took = repaired(f"what {victim.data_dir.name}'s lost disk held to be re-replicated")
        print(f"  waited {waited:.1f} s for earlier repairs; the wiped disk's copies were "
              f"whole again after {took:.1f} s", flush=True)
        return took
    elif kind == "postgres-restart":
        server.halt()
        time.sleep(rng.uniform(0.1, 2.0))  # how long the server is away
        server.resume()
    else:
        raise ValueError(f"not a fault of the store's other hosts: {kind!r}")
    return None


def _run(faults: int, seed: int, sequence: list[str] | None, between: int
         ) -> dict[str, Any]:
    rng, plan = fault_plan("network chaos", KINDS, faults, seed, sequence)
    counts = dict.fromkeys(KINDS, 0)
    repairs: list[float] = []  # seconds from a wipe to nothing left to re-replicate
    started = time.monotonic()
    names = ["bookie-0", "bookie-1", "bookie-2", "broker-a", "broker-b"]
    with Hosts(names) as hosts, tempfile.TemporaryDirectory() as tmp:
        server = PostgresServer(also_on=hosts.gateway)
        procs: list[Any] = []
        try:
            url = server.new_database().replace("127.0.0.1", hosts.gateway)
            bookies = start_bookies(hosts, Path(tmp), url)
            procs += bookies
            run_no = [0]

            def broker(name: str, *extra: str) -> BrokerProcess:
                run_no[0] += 1
                proc = BrokerProcess(Path(tmp) / f"{name}-{run_no[0]}", host=hosts.address(name),
                                     port=BROKER_PORT, args=broker_args(url, *extra),
                                     prefix=["ip", "netns", "exec", hosts.ns(name)])
                procs.append(proc)
                began = time.monotonic()
                proc.start(timeout=scaled(180))
                print(f"broker on {name} serving after {time.monotonic() - began:.1f} s",
                      flush=True)
                return proc

            serving, spare = "broker-a", "broker-b"
            current = broker(serving)
            with Admin(current.url) as admin:
                admin.create_topic(TOPIC, 2)
            addresses = ",".join(f"grpc://{hosts.address(n)}:{BROKER_PORT}"
                                 for n in ("broker-a", "broker-b"))
            # longer than a takeover of a hung broker (--takeover-after, recovery, reconnect),
            # as Pulsar's 30 s default is
            writer = _Writer(addresses, send_timeout=scaled(15))
            faults_done = [0]

            def replication() -> dict[str, Any]:
                with Admin(current.url) as admin:
                    return admin.stats()["replication"]  # type: ignore[no-any-return]

            def repaired(what: str) -> float:
                began = time.monotonic()
                wait_for(lambda: replication()["under_replicated"] == 0,
                         timeout=scaled(300), what=what)
                return time.monotonic() - began

            try:
                writer.wait_for_more(500)
                for n, kind in enumerate(plan):
                    counts[kind] += 1
                    if kind == "broker-kill":
                        current.kill()
                        serving, spare = spare, serving
                        current = broker(serving)
                    elif kind == "broker-hang":
                        hung = current
                        assert hung.proc is not None
                        hung.proc.send_signal(signal.SIGSTOP)
                        serving, spare = spare, serving
                        current = broker(serving, "--standby", "--takeover-after",
                                         f"{scaled(3):g}s")
                        hung.proc.send_signal(signal.SIGCONT)  # it finds itself fenced
                        if hung.proc.wait(timeout=scaled(120)) == 0:
                            raise AssertionError("a broker taken over exited 0")
                    else:
                        took = store_fault(kind, rng, bookies, hosts, server, writer, between,
                                           repaired)
                        if took is not None:
                            repairs.append(took)
                    writer.wait_for_more(between)
                    print(f"fault {n + 1}/{len(plan)}: {kind}; {writer.acked:,} acknowledged",
                          flush=True)
                    faults_done[0] = n + 1
            finally:
                try:
                    acked = writer.stop()
                except AssertionError:
                    print("serving broker said:", "".join(list(current.stderr_tail)[-30:]))
                    raise
            repaired("every segment to be whole again at the end")
            _check_disks(current.url, bookies)
            values = _read(f"grpc://{hosts.address(serving)}:{BROKER_PORT}")
            check_exactly_once_in_order(values, acked)
        finally:
            for proc in procs:
                proc.kill()
            server.stop()
    return {"faults": len(plan), **counts, "acknowledged": acked, "read": len(values),
            "repair_seconds": [round(r, 1) for r in repairs],
            "seconds": round(time.monotonic() - started)}


def _check_disks(url: str, bookies: list[BookieProcess]) -> None:
    """The stats match the bookies' disks: nothing listed, and every closed segment whole
    on each bookie of its ensemble (its index holds the segment's entries)."""
    from tierstream.managed_ledger.bookies.remote import RemoteBookie

    with Admin(url) as admin:
        # on a cluster every broker audits: one may list a copy another is repairing
        wait_for(lambda: admin.stats()["replication"]["under_replicated"] == 0,
                 timeout=scaled(120), what=f"{url} to list nothing to re-replicate")
        closed = [s for s in admin.list_segments(TOPIC) if s.state == "CLOSED"]
    clients = {f"bookie-{i}": RemoteBookie(f"bookie-{i}", str(b.url), host="-", epoch=0,
                                           auth_token=TOKEN) for i, b in enumerate(bookies)}
    try:
        held = {b: c.ledger_entries() for b, c in clients.items()}
        short = [(s.segment_id, b) for s in closed for b in s.ensemble
                 if held[b].get(s.segment_id, 0) < s.entries]
        assert not short, f"copies short or missing though the stats say none: {short}"
    finally:
        for c in clients.values():
            c.close()


def main(argv: list[str] | None = None) -> int:
    return chaos_main("network chaos", "python -m tests.store.network_chaos", KINDS, 20261126,
                      run, argv)


def chaos_main(what: str, prog: str, kinds: Sequence[str], seed: int,
               run: Callable[[int, int, list[str] | None], dict[str, Any]],
               argv: list[str] | None) -> int:
    """The command line of a chaos run: ``--faults``, ``--seed``, ``--sequence`` and
    ``--verbose`` (how clients follow partitions between brokers)."""
    import logging

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--sequence", help="comma-separated faults to replay instead: "
                        + ", ".join(kinds))
    parser.add_argument("--verbose", action="store_true",
                        help="log how the clients follow partitions from broker to broker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("tierstream.client").setLevel(logging.INFO)
    outcome = run(args.faults, args.seed, args.sequence.split(",") if args.sequence else None)
    print(f"{what} passed: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
