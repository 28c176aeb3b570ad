"""A transactional writer beside the chaos runs' producers (``cluster_chaos.py``): one
transaction after another, each of ``rows`` rows over every partition of its topic, committed
as a sink's numbered batch. A transaction that fails (its owner killed, paused, moving a
partition, the commit's answer lost) is written again under the same batch number: the
broker commits a sink's batch once, so each batch is in the log once, whichever attempt
committed it. :meth:`TxnWriter.check` reads the topic back: every committed batch's rows
once, each key in order, and nothing else."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

import tierstream
from tierstream.client import Admin
from tierstream.client.transaction import Transaction
from tierstream.errors import TierstreamError

from ..timing import scaled
from .helpers import wait_for
from .test_network_bookies import check_exactly_once_in_order

TXN_TOPIC = "acme/net/ledger"
_KEYS = 7


class TxnWriter:
    """Commits batches 0, 1, 2, ... on a thread of its own until :meth:`stop`."""

    def __init__(self, broker: str, *, rows: int = 20, token: str | None = None) -> None:
        self.broker, self.rows, self.token = broker, rows, token
        self.committed = 0  # batches committed, in order
        self.failures = 0  # attempts that failed and were written again
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _batch(self, n: int) -> pa.Table:
        first = n * self.rows
        numbers = range(first, first + self.rows)
        return pa.table({"key": [f"t{i % _KEYS}" for i in numbers],
                         "value": [f"t{i % _KEYS}:{i}".encode() for i in numbers]})

    def _run(self) -> None:
        while not self._stop.is_set():
            n = self.committed
            try:
                with Transaction(broker=self.broker, auth_token=self.token, sink="chaos",
                                 batch=n) as txn:
                    txn.write(TXN_TOPIC, self._batch(n))
            except TierstreamError as exc:  # written again, as a Spark task attempt is
                self.failures += 1
                self.last_error = exc
                self._stop.wait(0.2)
                continue
            self.committed = n + 1

    def wait_for_more(self, n: int) -> None:
        """Until ``n`` more batches are committed (each fault must let transactions end)."""
        target = self.committed + n
        wait_for(lambda: self.committed >= target, timeout=scaled(120),
                 what=f"{n} more transaction(s) committed (last error: {self.last_error!r})")

    def stop(self) -> int:
        """Stop after the transaction under way; the rows of the batches committed."""
        self._stop.set()
        self._thread.join(scaled(120))
        assert not self._thread.is_alive(), "the transactional writer did not stop"
        return self.committed * self.rows

    def check(self, committed_rows: int) -> None:
        """Every committed batch's rows once, each key in order; no row of another. A commit
        whose other owner did not answer (killed, paused, cut off, moving the partition) is
        shown there by that partition's owner at its next housekeeping pass: read once no
        transaction waits for that any more."""
        with Admin(self.broker, auth_token=self.token) as admin:
            assert admin.last_committed_batch("chaos") == committed_rows // self.rows - 1
            wait_for(lambda: not [t for t in admin.transactions() if t["state"] == "COMMITTED"],
                     timeout=scaled(60), what="every committed transaction to be shown in "
                     "each of its partitions")
        table: Any = tierstream.read(TXN_TOPIC, broker=self.broker, auth_token=self.token)
        values = [bytes(v).decode() for v in table.column("value").to_pylist()]
        numbers = {int(v.split(":")[1]) for v in values}
        missing = sorted({n // self.rows for n in set(range(committed_rows)) - numbers})
        if missing:  # which batches, and what the metadata says of each of their attempts
            with Admin(self.broker, auth_token=self.token) as admin:
                records = [t for t in admin.transactions() if t["batch_id"] in missing]
            raise AssertionError(f"committed batch(es) {missing} not read back, of "
                                 f"{committed_rows // self.rows}; their attempts: {records}")
        check_exactly_once_in_order(values, committed_rows)
        assert len(values) == committed_rows, \
            f"{len(values) - committed_rows} row(s) of batches never committed are shown"
