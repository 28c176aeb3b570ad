"""Planning without the store's files: through the broker, the same plan as from the file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tierstream.enumerator import Enumerator, Query
from tierstream.errors import NotFoundError
from tierstream.model.positions import Offset
from tierstream.splits.split import ReaderKind, Split

from ..logs import BASE, TOPIC, fill, running_log

QUERIES = [
    Query(topics=(TOPIC,)),
    Query(topics=(TOPIC,), key_ranges=4, max_split_bytes=2_000),
    Query(topics=(TOPIC,), start=Offset.at_time(BASE + 20_000), end=Offset.at_time(BASE + 70_000)),
    Query(topics=(TOPIC,), start=Offset.at_time(BASE + 95_000), end=Offset.latest()),
    Query(namespace="acme/web", reader=None, fail_on_data_loss=False),
]


def test_planning_through_the_broker_gives_the_plan_of_the_local_file(tmp_path: Path) -> None:
    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        fill(log, partitions=3, batches=13, keys=7)  # tiered, closed and open segments
        plog = log.store.partitions(TOPIC)[0]
        for seg in plog.closed_segments()[:2]:
            log.store.offloader.offload_segment(plog, seg)
        for p in log.store.partitions(TOPIC):
            p.flush_stats()  # the open segments' stats, as housekeeping would write them
        elsewhere = tmp_path / "not-here"  # a host that cannot see the data directory
        with Enumerator(data_dir=log.data_dir, broker=log.url) as local, \
                Enumerator(data_dir=elsewhere, broker=log.url) as remote:
            assert local.metadata_source.startswith("local file")
            assert remote.metadata_source.startswith("broker")
            kinds = set()
            for query in QUERIES:
                # a replica's local directory is a hint only the store's own host gets
                # (a remote planner has none): everything else is the same plan
                by_file = [_no_dirs(s) for s in local.plan(query)]
                by_broker = [_no_dirs(s) for s in remote.plan(query)]
                assert by_file and by_broker == by_file, query
                kinds |= {s.reader for s in by_file}
            assert kinds == set(ReaderKind)  # tiered, bookie and open segments all compared
        with Enumerator(data_dir=elsewhere, broker=log.url) as remote, \
                pytest.raises(NotFoundError, match="'acme/web/missing' does not exist"):
            remote.plan(Query(topics=("acme/web/missing",)))


def test_without_the_file_and_without_a_broker_the_error_names_the_data_dir(
        tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no metadata store at"):
        Enumerator(data_dir=tmp_path / "nowhere", broker=None)


def test_a_read_with_only_the_broker_address_returns_the_same_rows(tmp_path: Path) -> None:
    import tierstream

    with running_log(tmp_path / "data", maxEntriesPerSegment=3) as log:
        fill(log, partitions=2, batches=7, keys=5)
        here = tierstream.read(TOPIC, data_dir=str(log.data_dir), broker=log.url)
        elsewhere = tierstream.read(TOPIC, data_dir=str(tmp_path / "not-here"), broker=log.url)
        assert here.num_rows == elsewhere.num_rows > 0
        assert sorted(here.column("value").to_pylist()) == sorted(
            elsewhere.column("value").to_pylist())


def _no_dirs(split: Split) -> Split:
    return replace(split, replicas=tuple(replace(r, local_dir=None) for r in split.replicas))
