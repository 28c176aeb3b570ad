"""The host's tier cache (tier/cache.py): reads of S3 tier files (a moto server on loopback)
served again from local disk, never another object's bytes, never a corrupt or half-written
entry; the size bound and the admission policy; several processes on one directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest

from tierstream.broker.store import Store
from tierstream.readers import ReadStats, open_reader
from tierstream.readers.stats import OBJECT_STORE, TIER_CACHE
from tierstream.splits.split import Split
from tierstream.tier import cache as cache_module
from tierstream.tier import host_cache as host_module
from tierstream.tier.cache import ObjectRef, TierCache

from .. import forkserver
from ..store.test_tier import TOPIC, fill, make_store
from .test_parquet_tier import _tier_split


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own cache directory, as a host's (the environment)."""
    where = tmp_path / "tier-cache"
    monkeypatch.setenv("TIERSTREAM_TIER_CACHE_DIR", str(where))
    monkeypatch.setenv("TIERSTREAM_TIER_CACHE_SIZE", "64MiB")
    return where


def _read(split: Split, caplog: pytest.LogCaptureFixture) -> tuple[pa.Table, ReadStats, int]:
    """The split's rows, the paths they took, and the blocks fetched from S3 for them (the
    cache's misses: one ranged GET each)."""
    where = Path(os.environ["TIERSTREAM_TIER_CACHE_DIR"])
    before = _stats(where)["misses"] if (where / "index.sqlite3").exists() else 0
    stats = ReadStats()
    rows = pa.Table.from_batches(list(open_reader(split, stats=stats)))
    return rows, stats, _stats(where)["misses"] - before


def _stats(where: Path) -> dict[str, int]:
    return TierCache(where, 0).stats().to_dict()


def _split(store: Store, where: Path) -> Split:
    """The store's tier split, with the cache emptied: the store itself reads the tier file
    through it when asked for its last position."""
    split = _tier_split(store)
    TierCache(where, 0).clear()
    return split


def test_a_second_read_comes_from_the_cache_and_says_so(
        s3_store: Store, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    split = _split(s3_store, cache_dir)
    first, stats, gets = _read(split, caplog)
    assert first.num_rows == 1000 and gets >= 1
    assert stats.rows(path=OBJECT_STORE) == 1000
    s3_store.tier.delete(split.tier_url or "")  # nothing to fetch any more: all local
    again, stats, gets = _read(split, caplog)
    assert gets == 0
    assert stats.rows(path=TIER_CACHE) == 1000 and stats.rows(path=OBJECT_STORE) == 0
    assert again.equals(first)
    counted = _stats(cache_dir)
    assert counted["misses"] >= 1 and counted["hits"] == counted["misses"]
    assert counted["hit_bytes"] == counted["miss_bytes"] == counted["size"] == split.tier_bytes


def test_another_store_or_a_recreated_topic_is_never_served_from_the_cache(
        data_dir: Path, s3_bucket: str, moto_endpoint: str, cache_dir: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The same bucket and names through another endpoint is another store; a topic deleted
    and created again under the same tier prefix writes new objects."""
    store = make_store(data_dir, tierUrl=f"s3://{s3_bucket}/tier", s3Endpoint=moto_endpoint)
    try:
        fill(store, entries=10)
        store.offloader.offload_topic(TOPIC)
        old = _split(store, cache_dir)
        before, _, _ = _read(old, caplog)
        store.delete_topic(TOPIC)
        store.create_topic(TOPIC, 1)
        plog = store.partition(TOPIC, 0)
        from tierstream.model.message_format import as_produce_batch

        for e in range(10):
            plog.append(as_produce_batch(pa.record_batch({
                "key": [f"other-{j}" for j in range(100)],
                "value": [f"new-{e}-{j}".encode() for j in range(100)]})),
                producer=None, sequence_id=None)
        store.offloader.offload_topic(TOPIC)
        new = _split(store, cache_dir)
    finally:
        store.close()
    assert new.tier_url != old.tier_url  # a fresh name per offload (tier/storage.py)
    after, stats, gets = _read(new, caplog)
    assert gets >= 1 and stats.rows(path=TIER_CACHE) == 0
    assert set(after.column("value").to_pylist()).isdisjoint(before.column("value").to_pylist())
    # the same object by another endpoint of the same server: another store's name
    elsewhere = moto_endpoint.replace("127.0.0.1", "localhost")
    from dataclasses import replace

    from tierstream.splits.split import TierLocation

    same, stats, gets = _read(replace(new, tier=TierLocation(s3_endpoint=elsewhere)), caplog)
    assert gets >= 1 and stats.rows(path=TIER_CACHE) == 0 and same.equals(after)


def test_a_corrupt_entry_is_dropped_and_fetched_again(
        s3_store: Store, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    split = _split(s3_store, cache_dir)
    first, _, _ = _read(split, caplog)
    (copy,) = [p for p in (cache_dir / "objects").rglob("*") if p.is_file()]
    raw = bytearray(copy.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    copy.write_bytes(bytes(raw))
    host_module._open.clear()  # another process: it checks the copy before using it
    again, stats, gets = _read(split, caplog)
    assert again.equals(first) and gets >= 1 and stats.rows(path=OBJECT_STORE) == 1000
    assert _stats(cache_dir)["corrupt"] == 1
    third, stats, gets = _read(split, caplog)  # kept again, whole
    assert gets == 0 and third.equals(first) and stats.rows(path=TIER_CACHE) == 1000


def test_a_writer_killed_mid_block_leaves_nothing_that_is_served(
        s3_store: Store, cache_dir: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process reserves a block and dies halfway through writing it in place: its bytes
    are never read as the block; once abandoned, the reservation goes and the block is kept."""
    split = _split(s3_store, cache_dir)
    killed = subprocess.run([sys.executable, "-c", _HALF_WRITER, str(cache_dir),
                             json.dumps(split.to_dict())], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p for p in (cache_dir / "objects").rglob("*") if p.is_file()]  # the half block
    rows, stats, gets = _read(split, caplog)
    assert rows.num_rows == 1000 and gets >= 1 and stats.rows(path=OBJECT_STORE) == 1000
    _, stats, gets = _read(split, caplog)  # still reserved by the dead writer: not kept
    assert gets >= 1 and stats.rows(path=TIER_CACHE) == 0
    monkeypatch.setattr(cache_module, "_ABANDONED_S", 0.0)  # abandoned now
    first, _, _ = _read(split, caplog)
    again, stats, gets = _read(split, caplog)
    assert gets == 0 and stats.rows(path=TIER_CACHE) == 1000 and again.equals(first)


_HALF_WRITER = """
import json, os, signal, sys
from tierstream.splits.split import Split
from tierstream.tier.cache import ObjectRef
from tierstream.tier.host_cache import host_cache
from tierstream.tier.storage import TierStorage
split = Split.from_dict(json.loads(sys.argv[2]))
tier = TierStorage(url=split.tier_url, s3_endpoint=split.tier.s3_endpoint)
cache = host_cache(sys.argv[1], 64 << 20)
obj = ObjectRef(tier.filesystem(), tier.path(split.tier_url), split.tier_bytes,
                f"s3:{split.tier.s3_endpoint}")
assert cache._admit(obj, 0, split.tier_bytes)  # reserved
data = obj.fs.cat_file(obj.path, start=0, end=split.tier_bytes)
path = cache._file(obj.ident)
path.parent.mkdir(exist_ok=True)
with open(path, "wb") as f:
    f.write(data[: len(data) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write
"""


def _objects(tmp_path: Path, count: int, size: int) -> list[ObjectRef]:
    fs = fsspec.filesystem("file")
    out = []
    for i in range(count):
        path = tmp_path / f"object-{i}"
        path.write_bytes(os.urandom(size))
        out.append(ObjectRef(fs, str(path), size, "file:"))
    return out


def test_a_scan_twice_the_cache_keeps_hitting_half_and_the_bound_holds(tmp_path: Path) -> None:
    """A backfill is a sequential scan: plain LRU keeps the last half of a window twice its
    size and hits nothing on the next pass; admission by frequency keeps the first half."""
    block = 1024
    cache = TierCache(tmp_path / "cache", 32 * block, block_size=block)
    window = _objects(tmp_path, 4, 16 * block)  # 64 blocks: twice the cache
    for scan in range(4):
        hits = 0
        for obj in window:
            for i in range(16):
                data, hit = cache.block(obj, i)
                assert data == Path(obj.path).read_bytes()[i * block:(i + 1) * block]
                hits += hit
                assert cache.stats().size <= cache.limit
        assert hits == (0 if scan == 0 else 32), (scan, hits)
    # something read more often than what is kept gets in: each block kept was read 4 times,
    # a new object's blocks are kept on their 5th read and hit on the 6th
    (tmp_path / "hot").mkdir()
    (hot,) = _objects(tmp_path / "hot", 1, 4 * block)
    for _ in range(5):
        assert sum(cache.block(hot, i)[1] for i in range(4)) == 0
    assert sum(cache.block(hot, i)[1] for i in range(4)) == 4
    stats = cache.stats()
    assert stats.size <= cache.limit and stats.evictions >= 4 and stats.rejected > 0


def test_processes_sharing_a_directory_read_true_bytes_within_the_bound(tmp_path: Path) -> None:
    block = 4096
    objects = _objects(tmp_path, 6, 40 * block)
    where = tmp_path / "cache"
    script = """
import random, sys
from pathlib import Path
import fsspec
from tierstream.tier.cache import ObjectRef, TierCache
where, block, seed, paths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
cache = TierCache(where, 60 * block, block_size=block)
fs = fsspec.filesystem("file")
rng = random.Random(seed)
objs = [ObjectRef(fs, p, 40 * block, "file:") for p in paths]
truth = {p: Path(p).read_bytes() for p in paths}
for _ in range(600):
    obj = rng.choice(objs[:3] if rng.random() < 0.7 else objs)
    i = rng.randrange(40)
    data, _ = cache.block(obj, i)
    assert data == truth[obj.path][i * block:(i + 1) * block], (obj.path, i)
    assert cache.stats().size <= cache.limit
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(where), str(block), str(seed),
                               *(o.path for o in objects)], stderr=subprocess.PIPE, text=True)
             for seed in range(3)]
    for proc in procs:
        _, stderr = proc.communicate()
        assert proc.returncode == 0, stderr
    cache = TierCache(where, 60 * block, block_size=block)
    stats = cache.stats()
    assert 0 < stats.size <= 60 * block and stats.hits > 0
    # every block the index holds is in its object's local copy, whole and true
    for obj in objects:
        truth = Path(obj.path).read_bytes()
        for i in range(40):
            if (got := cache._load(obj, i)) is not None:
                assert got[0] == truth[i * block:(i + 1) * block]
    assert cache.stats().corrupt == 0


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return forkserver.run([sys.executable, "-m", "tierstream", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})


def test_cache_stats_and_clear_and_a_bad_size(
        s3_store: Store, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    split = _split(s3_store, cache_dir)
    _read(split, caplog)
    _read(split, caplog)
    shown = _cli("cache", "stats", "--json")
    assert shown.returncode == 0, shown.stderr
    stats = json.loads(shown.stdout)
    assert stats["hits"] == stats["misses"] == 1 and stats["size"] == split.tier_bytes
    table = _cli("cache", "stats")
    assert "hits" in table.stdout and "1 of 2 block reads (50%)" in table.stdout, table.stdout
    cleared = _cli("cache", "clear", "--yes")
    assert cleared.returncode == 0 and "freed" in cleared.stdout
    assert json.loads(_cli("cache", "stats", "--json").stdout)["size"] == 0
    assert not any(p.is_file() for p in (cache_dir / "objects").rglob("*"))
    bad = _cli("read", TOPIC, "--out", "x.parquet", "--tier-cache-size", "lots")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "invalid --tier-cache-size: 'lots'" in bad.stderr
    missing = _cli("cache", "stats", "--dir", str(cache_dir / "nowhere"))
    assert missing.returncode == 2 and "no tier cache in" in missing.stderr


def test_the_history_halves_without_losing_the_block_being_counted(tmp_path: Path) -> None:
    """Regression: every 10 cache-sizes of accesses the counts are halved and zeros dropped;
    a block read for the first time at that moment lost its own count, and the read failed
    (TypeError: cannot unpack non-iterable NoneType)."""
    block = 1024
    cache = TierCache(tmp_path / "cache", 16 * block, block_size=block)
    (obj,) = _objects(tmp_path, 1, 200 * block)
    truth = Path(obj.path).read_bytes()
    for i in range(200):  # the 160th access halves the history
        assert cache.block(obj, i)[0] == truth[i * block:(i + 1) * block]


def test_the_bound_holds_under_a_window_ten_times_the_cache(tmp_path: Path) -> None:
    block = 1024
    cache = TierCache(tmp_path / "cache", 8 * block, block_size=block)
    window = _objects(tmp_path, 20, 4 * block)  # 80 blocks
    for _ in range(3):
        for obj in window:
            for i in range(4):
                assert cache.block(obj, i)[0] == Path(obj.path).read_bytes()[
                    i * block:(i + 1) * block]
                assert cache.stats().size <= cache.limit
    copies = [p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()]
    # on disk too (sparse copies: what is written, rounded up to the filesystem's blocks)
    assert sum(p.stat().st_blocks * 512 for p in copies) <= cache.limit + len(copies) * 4096


def test_the_host_cache_follows_its_arguments_and_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tier file a read opens asks host_cache which cache to use, and the answer is
    remembered: it must still follow the environment and the working directory."""
    monkeypatch.setenv(host_module.DIR_ENV, str(tmp_path / "a"))
    monkeypatch.delenv(host_module.SIZE_ENV, raising=False)
    first = host_module.host_cache()
    assert first is not None and first.directory == tmp_path / "a"
    assert host_module.host_cache() is first
    monkeypatch.setenv(host_module.DIR_ENV, str(tmp_path / "b"))
    assert host_module.host_cache().directory == tmp_path / "b"  # type: ignore[union-attr]
    monkeypatch.setenv(host_module.SIZE_ENV, "0")
    assert host_module.host_cache() is None
    monkeypatch.setenv(host_module.SIZE_ENV, "1MiB")
    sized = host_module.host_cache()
    assert sized is not None and sized.limit == 1 << 20
    assert host_module.host_cache(size=2 << 20).limit == 2 << 20  # type: ignore[union-attr]
    for where in ("a", "b"):
        monkeypatch.chdir(tmp_path / where)
        here = host_module.host_cache("here")
        assert here is not None and here.directory == tmp_path / where / "here"
    host_module._open.clear()  # as in a new process: opened again, not the one of before
    again = host_module.host_cache("here")
    assert again is not None and again is not here and again.directory == here.directory
