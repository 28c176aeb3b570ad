"""The bookie-log reader over a bookie endpoint vs over local files (issue 13).

One sealed segment is read twice per run, interleaved: from the ledger files on this host,
and from a ``tierstream bookie serve`` process serving the same directory on loopback (what a
Spark executor on another host does). Also the wire bytes of k = 4 key-range splits against
one whole-range split over an endpoint: the endpoint filters key ranges before sending.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.flight as flight

from bench.framework_bench import _segment
from bench.harness import (
    Figure,
    ProcessCpu,
    console,
    cost_figures,
    loop_unit_us,
    report,
    sized,
    timed,
)
from tierstream.bookie.server import BookieServer
from tierstream.model.positions import KeyRange, Position
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind, Replica, Split
from tierstream.wire.flight import encode


def remote_bookie(quick: bool = True) -> Path:
    entries, per_entry, runs = sized((200, 1000, 5) if quick else (500, 2000, 7), (10, 100, 1))
    with tempfile.TemporaryDirectory() as tmp:
        store, seg = _segment(Path(tmp) / "data", entries, per_entry)
        bookie_dir = store.config.bookie_dir("bookie-0").resolve()
        store.close()
        server = BookieServer(bookie_dir, bookie_id="bookie-0")  # in-process: byte counts
        threading.Thread(target=server.serve, daemon=True).start()
        proc = subprocess.Popen([sys.executable, "-m", "tierstream", "bookie", "serve", "--dir",
                                 str(bookie_dir)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            found = re.search(r"listening on (\S+)", proc.stdout.readline())
            assert found, "tierstream bookie serve did not start"
            local = Split(topic="bench/read/t", partition=0, segment_id=seg.segment_id,
                          start=Position(0, seg.segment_id, 0, 0),
                          end=Position(0, seg.segment_id, seg.entries, 0),
                          reader=ReaderKind.BOOKIE,
                          replicas=(Replica("bookie-0", None, str(bookie_dir)),))
            remote = replace(local, replicas=(Replica("bookie-0", found.group(1), None),))
            counted = replace(local, replicas=(Replica("bookie-0", server.url, None),))

            def count(split: Split) -> int:
                return sum(b.num_rows for b in open_reader(split))

            messages = entries * per_entry
            assert count(local) == count(remote) == messages
            client = flight.FlightClient(found.group(1))
            ticket = flight.Ticket(encode({"op": "entries", "segment_id": seg.segment_id,
                                           "first": 0, "end": None, "key_range": [0, 65536]}))

            def transport() -> int:  # the same frames over the same stream, not even parsed
                return sum(chunk.data.num_rows for chunk in client.do_get(ticket))

            ours, base, wire_only = [], [], []
            remote_cpu, local_cpu = list[ProcessCpu](), list[ProcessCpu]()
            for _ in range(runs):  # interleaved: drift hits all sides alike
                with ProcessCpu(proc.pid) as used:
                    ours.append(messages / timed(lambda: count(remote)))
                remote_cpu.append(used)
                with ProcessCpu(proc.pid) as used:
                    base.append(messages / timed(lambda: count(local)))
                local_cpu.append(used)
                wire_only.append(messages / timed(transport))
            client.close()
            unit = loop_unit_us()

            def wire(k: int) -> int:
                before = server.bytes_served
                rows = sum(count(replace(counted, key_range=r)) for r in KeyRange.split(k))
                assert rows == messages
                return server.bytes_served - before

            whole = wire(1)
            amplification = {k: wire(k) / whole for k in (2, 4, 8)}
        finally:
            proc.kill()
            proc.wait()
            server.shutdown()
    console.print("wire bytes per byte of a whole-range read: " + ", ".join(
        f"k={k}: {a:.3f}" for k, a in amplification.items()))
    figures: list[Any] = [
        Figure("bookie-log over the endpoint, rows/s", "rows/s", ours,
               "bookie-log over local files", base, aim="ratio >= 0.7",
               aim_check=lambda v, r: r is not None and r >= 0.7),
        Figure("bookie-log over the endpoint, rows/s ", "rows/s", ours,
               "the endpoint's Flight stream alone (transport ceiling)", wire_only),
        Figure("wire bytes of k=4 key ranges / k=1", "x", [amplification[4]],
               aim="<= 1.25", higher_is_better=False, aim_check=lambda v, r: v <= 1.25),
        # the reader's process (client) and the bookie server's; a local read has no server
        *cost_figures("bookie-log over the endpoint", messages, remote_cpu, unit,
                      baseline=("bookie-log over local files", local_cpu),
                      server="bookie server"),
    ]
    return report("remote-bookie", figures, {"messages": messages, "entries": entries,
                                             "per_entry": per_entry,
                                             "amplification": amplification})
