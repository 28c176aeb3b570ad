"""Transactions staged by an older tierstream, outside the log: finished at broker start.

Before transactions were written once (``transaction_coordinator.py``), a transaction's rows
were staged in Arrow IPC files under ``<data dir>/transactions/<txn id>/<topic>/
<partition>.<ns>.<rows>[.<count>].arrow`` and appended at its commit. A broker that starts on
such a data directory appends the files of a transaction that was committed (as that version
would have: the producer ``txn/<id>``, sequence ids 0, 1, 2...), and aborts an open or prepared
one, which this version cannot commit; then it removes the folder.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from tierstream.errors import ConfigError, NotFoundError, StorageError
from tierstream.managed_ledger.open_segment import TXN_PRODUCER
from tierstream.metadata.transaction_records import TransactionRecords, TxnState
from tierstream.model.message_format import batches_of_about
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.managed_ledger.partition_log import PartitionLog

__all__ = ["finish_old_staging"]

log = logging.getLogger(__name__)


def finish_old_staging(root: Path, records: TransactionRecords,
                       partition: Callable[[str, int], PartitionLog | None],
                       entry_bytes: int) -> None:
    """Append committed transactions' old staged files, abort the others, remove them."""
    if not root.is_dir():
        return
    for folder in sorted(root.iterdir()):
        txn_id = folder.name
        try:
            record = records.get(txn_id)
        except (NotFoundError, ConfigError):
            record = None
        if record is not None and record.state == TxnState.COMMITTED:
            for (topic, p), paths in _old_staged(folder).items():
                plog = partition(topic, p)
                if plog is None:
                    continue
                tables = [pa.ipc.open_stream(pa.OSFile(str(x))).read_all() for x in paths]
                rows = pa.concat_tables(tables).combine_chunks()
                for seq, batch in enumerate(batches_of_about(rows, entry_bytes)):
                    plog.append(batch, producer=TXN_PRODUCER + txn_id, sequence_id=seq)
            records.applied([txn_id], now_ms())
            log.info("transaction %s, staged by an older tierstream: applied", txn_id)
        elif record is not None:
            records.abort([txn_id], now_ms(), "staged by an older tierstream, which this one "
                          "cannot commit; write it again")
        _remove(folder)
    _remove(root)


def _old_staged(folder: Path) -> dict[tuple[str, int], list[Path]]:
    """An older version's staged files of one transaction, per (topic, partition), in
    staging order (``<topic path>/<partition>.<ns>.<rows>[.<count>].arrow``)."""
    out: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    for path in folder.rglob("*.arrow"):
        partition, ns, _ = path.name.split(".")[:3]
        topic = str(path.parent.relative_to(folder))
        out.setdefault((topic, int(partition)), []).append((int(ns), path))
    return {k: [p for _, p in sorted(v)] for k, v in sorted(out.items())}


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot remove {str(path)!r}: {exc}") from None
