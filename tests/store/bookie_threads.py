"""One process with a network bookie and the broker's client of it, a fault point armed
(``TIERSTREAM_FAULT_AT``: faults are armed per process): appends go on until the fault has
fired, and what became of each is printed as one JSON line::

    TIERSTREAM_FAULT_AT=bookie.client.send@2 python -m tests.store.bookie_threads DIR
    TIERSTREAM_FAULT_AT=bookie.journal@3 python -m tests.store.bookie_threads DIR journal

``{"failed": n, "stored": m, "dead_after": bool, "available": bool}``: appends that failed
(UnavailableError, never a hang: each waits at most its deadline), appends stored, whether
the client refuses appends after the failed thread (every one fails at once) and whether it
says it takes writes (placement asks). With ``journal``: a bookie's own journal thread, and
``{"stored": m, "failed": [errors], "later": error}`` — every append either stored or failed,
none waits, and one sent after the failure fails at once.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from tierstream.bookie.server import BookieServer
from tierstream.bookie.storage import Bookie
from tierstream.errors import TierstreamError, UnavailableError
from tierstream.managed_ledger.bookies.remote import RemoteBookie
from tierstream.model.message_format import MESSAGE_SCHEMA

from ..timing import scaled


def _payload(entry_id: int) -> pa.Buffer:
    row: dict[str, Any] = {f.name: None for f in MESSAGE_SCHEMA}
    row.update(key="k", key_hash=1, value=f"v{entry_id}".encode(), publish_time=entry_id,
               partition=0, segment_id=7, entry_id=entry_id, batch_index=0, properties=[])
    return pa.RecordBatch.from_pylist([row], schema=MESSAGE_SCHEMA).serialize()


def main(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    server = BookieServer(root, bookie_id="b0", writable=True, fsync=False)
    assert server.writes is not None
    server.writes.claimed("test-instance", 0)
    bookie = RemoteBookie("b0", server.url, host="h0", epoch=1, timeout_s=scaled(2),
                          retry_s=0.2)
    failed = stored = 0
    ledger, entry = 7, 0
    until = time.monotonic() + scaled(4)  # past a few passes of every thread
    try:
        while time.monotonic() < until:  # ledgers of a few entries: a failure ends one
            try:
                bookie.append(ledger, entry, {}, _payload(entry), 1, entry, entry).result(
                    timeout=scaled(30))
                stored += 1
                entry += 1
                time.sleep(0.05)
            except UnavailableError:
                failed += 1
                ledger, entry = ledger + 1, 0  # the broker writes a new segment...
                time.sleep(0.3)  # ...on a bookie taken for gone only after retry_s
        try:
            bookie.append(ledger, entry, {}, _payload(entry), 1, 0, 0).result(
                timeout=scaled(30))
            taken = True
        except UnavailableError:
            taken = False
        available = bookie.is_available()
    finally:
        bookie.close()
        server.shutdown()
    print(json.dumps({"failed": failed, "stored": stored, "dead_after": not taken,
                      "available": available}), flush=True)


def journal(root: Path) -> None:
    bookie = Bookie("b0", root, fsync=False)
    bookie.create_ledger(7)
    stored, failed = 0, []
    for i in range(10):  # one at a time: one pass of the journal each
        try:  # never a hang: each completes, stored or failed
            bookie.append(7, i, {}, _payload(i), 1, i, i).result(timeout=scaled(30))
            stored += 1
        except TierstreamError as exc:
            failed.append(str(exc))
    later = bookie.append(7, 10, {}, _payload(10), 1, 10, 10)
    try:
        later.result(timeout=scaled(5))
        said = ""
    except TierstreamError as exc:
        said = str(exc)
    bookie.close()
    print(json.dumps({"stored": stored, "failed": failed, "later": said}), flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["journal"]:
        journal(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
