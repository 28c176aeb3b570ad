"""A tier file on another host is read through the broker; a missing one is data loss."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from tierstream.enumerator import Enumerator, Query
from tierstream.errors import DataLossError, UnavailableError
from tierstream.readers import open_reader
from tierstream.splits.split import ReaderKind

from ..logs import TOPIC, fill, running_log


def _rows(split) -> list[bytes]:  # type: ignore[no-untyped-def]
    batches = list(open_reader(split))
    return pa.Table.from_batches(batches).column("value").to_pylist() if batches else []


def test_a_tier_file_this_host_cannot_see_is_read_through_the_broker(tmp_path: Path) -> None:
    # Regression: the reader called a tier file on another host "gone (deleted by retention)".
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        fill(log, partitions=1, batches=7, keys=5)
        plog = log.store.partitions(TOPIC)[0]
        log.store.offloader.offload_segment(plog, plog.closed_segments()[0])
        with Enumerator(data_dir=log.data_dir, broker=log.url) as enum:
            (split,) = [s for s in enum.plan(Query(topics=(TOPIC,)))
                        if s.reader is ReaderKind.TIER]
        assert split.tier_url is not None
        here = _rows(split)
        # the same file as another host sees it: the tier's directory is not there
        elsewhere = replace(split, tier_url=split.tier_url.replace(str(tmp_path),
                                                                   "/no-such-host-dir"))
        assert sorted(_rows(elsewhere)) == sorted(here) and here  # key-bucketed vs log order
        with pytest.raises(UnavailableError, match="is on another host"):
            _rows(replace(elsewhere, broker=None))
        # a file missing where its directory is: retention, after planning
        Path(split.tier_url.removeprefix("file://")).unlink()
        with pytest.raises(DataLossError, match="is gone"):
            _rows(split)
