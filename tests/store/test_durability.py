"""Crashes, torn tails, corruption and de-duplication, with real broker processes."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tierstream.bookie.storage import ledger_paths
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer
from tierstream.errors import CorruptionError, UnavailableError
from tierstream.model.message_format import as_produce_batch

from ..timing import scaled
from .helpers import positions, read_all, stop_process, wait_for

TOPIC = "acme/web/orders"
REPLICATED = ("--bookies", "3", "--write-quorum", "3", "--ack-quorum", "2")


def _produce_until_killed(url: str, broker: BrokerProcess, producers: int = 4
                          ) -> dict[str, list[str]]:
    """Several producers send small batches; the broker is SIGKILLed mid-stream.

    Returns, per producer, the values the broker acknowledged before the kill.
    """
    acked: dict[str, list[str]] = defaultdict(list)
    total = [0]
    lock = threading.Lock()

    def run(name: str) -> None:
        try:
            with Producer(TOPIC, broker=url, name=name, batch_size=20,
                          send_timeout=scaled(2.0)) as producer:
                for chunk in range(10_000):
                    values = [f"{name}-{chunk}-{i}" for i in range(20)]
                    producer.send_many({"value": v.encode(), "key": f"{name}-{i % 5}"}
                                       for i, v in enumerate(values))
                    with lock:
                        acked[name].extend(values)
                        total[0] += len(values)
        except UnavailableError:
            return  # the broker is gone: what was acknowledged is in `acked`

    threads = [threading.Thread(target=run, args=(f"p{i}",)) for i in range(producers)]
    for t in threads:
        t.start()
    wait_for(lambda: total[0] >= 4_000, what="producers to get acknowledgements")
    broker.kill()
    for t in threads:
        t.join(timeout=scaled(60))
    return acked


@pytest.mark.parametrize("bookie_args", [(), REPLICATED], ids=["1-bookie", "3-bookies-wq3-aq2"])
def test_sigkill_loses_no_acknowledged_message(start_broker, bookie_args) -> None:
    broker = start_broker(*bookie_args)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 3)
    acked = _produce_until_killed(broker.url, broker)
    restarted = start_broker(*bookie_args)
    table = read_all(restarted.url, TOPIC)
    stored = table.column("value").to_pylist()
    stored_set = {v.decode() for v in stored}
    missing = [v for vals in acked.values() for v in vals if v not in stored_set]
    assert missing == [], f"{len(missing)} acknowledged message(s) lost"
    assert len(stored) == len(stored_set), "a message was stored twice"
    # in order: per producer key, values increase along the log
    per_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for v in stored:
        name, chunk, i = v.decode().split("-")
        per_key[f"{name}-{int(i) % 5}"].append((int(chunk), int(i)))
    assert all(seq == sorted(seq) for seq in per_key.values())
    # the open segments were sealed by recovery, and new ones opened
    with Admin(restarted.url) as admin:
        segs = admin.list_segments(TOPIC)
        assert sum(1 for s in segs if s.state == "OPEN") == 3
        stats = admin.stats()
    assert stats["recovered_segments"], "recovery should have sealed the crashed segments"


def _ledger_files(data_dir: Path, bookie: str = "bookie-0") -> list[Path]:
    return sorted((data_dir / "bookies" / bookie / "ledgers").rglob("*.log"))


def test_torn_tail_is_cut_and_earlier_entries_survive(start_broker, data_dir) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode()} for i in range(100))  # 10 entries
    broker.kill()  # the segment stays OPEN on disk
    (log,) = _ledger_files(data_dir)
    size = log.stat().st_size
    with open(log, "r+b") as f:
        f.truncate(size - 37)  # mid-frame: the last entry is torn
    restarted = start_broker()
    values = read_all(restarted.url, TOPIC).column("value").to_pylist()
    assert values == [f"v{i}".encode() for i in range(90)]
    with Admin(restarted.url) as admin:
        seg = admin.list_segments(TOPIC)[0]
        assert (seg.state, seg.entries, seg.messages) == ("CLOSED", 9, 90)
        recovered = admin.stats()["recovered_segments"]
    assert recovered[0]["cut_bytes"] > 0


def _flip_byte(path: Path, offset_from_end: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - offset_from_end)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_replica_is_detected_and_another_one_read(start_broker, data_dir) -> None:
    broker = start_broker(*REPLICATED)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode()} for i in range(50))
    assert broker.stop() == 0  # clean: the segment is sealed, nothing cached after restart
    victims = [p for p in _ledger_files(data_dir, "bookie-0")]
    assert victims
    for p in victims:
        _flip_byte(p)
    restarted = start_broker(*REPLICATED)
    values = read_all(restarted.url, TOPIC).column("value").to_pylist()
    assert values == [f"v{i}".encode() for i in range(50)]
    with Admin(restarted.url) as admin:
        stats = admin.stats()
    assert stats["replica_failures"] >= 1
    assert stats["checksum_failures"]["bookie-0"] >= 1


def test_every_replica_corrupt_is_a_corruption_error_never_wrong_bytes(
        start_broker, data_dir) -> None:
    broker = start_broker(*REPLICATED)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, batch_size=10) as producer:
        producer.send_many({"value": f"v{i}".encode()} for i in range(50))
    assert broker.stop() == 0
    for bookie in ("bookie-0", "bookie-1", "bookie-2"):
        for p in _ledger_files(data_dir, bookie):
            _flip_byte(p)
    restarted = start_broker(*REPLICATED)
    with pytest.raises(CorruptionError, match="unreadable on every replica"):
        read_all(restarted.url, TOPIC)


def test_a_retrying_producer_stores_each_sequence_id_once(start_broker) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    producer = Producer(TOPIC, broker=broker.url, name="importer", batch_size=10,
                        max_in_flight=64, send_timeout=scaled(30))
    # Pipeline 40 batches without waiting, wait until the broker has stored some of them,
    # then kill it: the producer holds batches the broker stored but never acknowledged.
    batches = [as_produce_batch(pa.record_batch({"value": [f"b{b}-{i}".encode()
                                                           for i in range(10)]}))
               for b in range(40)]
    for b in batches:
        producer._send(0, b)
    wait_for(lambda: len(read_all(broker.url, TOPIC)) >= 100, what="some batches stored")
    broker.kill()
    restarted = start_broker()
    producer._client = type(producer._client)(restarted.url)
    producer.flush()  # reconnects and re-sends every unacknowledged batch
    values = read_all(restarted.url, TOPIC).column("value").to_pylist()
    assert len(values) == 400 and len(set(values)) == 400
    # An explicit retry of an old sequence id is acknowledged as a duplicate, not stored.
    stream = producer._streams[0]
    stream.next_seq = 3
    producer._send(0, batches[3])
    producer.flush()
    assert producer._acks[-1]["duplicate"] is True
    assert len(read_all(restarted.url, TOPIC)) == 400
    producer.close()
    # A new producer with the same name continues after the last stored sequence id.
    with Producer(TOPIC, broker=restarted.url, name="importer") as again:
        assert again._streams[0].next_seq == 40
        again.send("after")
    assert len(read_all(restarted.url, TOPIC)) == 401


def test_positions_survive_restart(start_broker) -> None:
    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    with Producer(TOPIC, broker=broker.url, batch_size=7) as producer:
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i}"} for i in range(300))
    before = read_all(broker.url, TOPIC)
    assert broker.stop() == 0
    after = read_all(start_broker().url, TOPIC)
    assert positions(before) == positions(after)
    assert before.column("value").to_pylist() == after.column("value").to_pylist()


def test_ledger_paths_are_under_the_bookie_directory(tmp_path: Path) -> None:
    log, idx = ledger_paths(tmp_path, 123456)
    assert log.parent == idx.parent and tmp_path in log.parents


def test_a_named_producer_reopened_after_one_stored_batch_stores_its_next_batch(broker) -> None:
    # Regression: a stored last sequence id of 0 was read as "none", so the reopened producer
    # reused sequence id 0 and its message was acknowledged as a duplicate, and dropped.
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    with Producer(TOPIC, broker=broker.url, name="importer") as first:
        first.send("first", key="k")
    with Producer(TOPIC, broker=broker.url, name="importer") as again:
        ack = again.send("second", key="k")
    assert ack["duplicate"] is False and ack["sequence_id"] == 1
    assert read_all(broker.url, TOPIC).column("value").to_pylist() == [b"first", b"second"]


@contextmanager
def _small_disk(path: Path) -> Iterator[Path]:
    """``path`` on a 2 MB tmpfs (skips the test where mounting is not allowed); yields the
    file that :func:`_fill` fills it with."""
    import subprocess

    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {mounted.stderr.strip()}")
    try:
        yield path / "filler"
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(filler: Path) -> None:
    with open(filler, "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def test_a_batch_whose_write_failed_is_stored_when_retried(start_broker, data_dir) -> None:
    # Regression: the broker recorded a sequence id when the entry was submitted, not when it
    # was stored. A write that failed (here: a full disk) was retried by the producer and
    # acknowledged as a duplicate: an acknowledged message that was never stored.
    from .crashcheck import check, send_numbered

    with _small_disk(data_dir / "bookies" / "bookie-0") as filler:
        broker = start_broker()
        with Admin(broker.url) as admin:
            admin.create_topic(TOPIC, 1)
        producer = Producer(TOPIC, broker=broker.url, name="writer", batch_size=5,
                            send_timeout=scaled(60))
        sends = [send_numbered(producer, 0, 20)]
        _fill(filler)
        result: list[Any] = []
        sender = threading.Thread(target=lambda: result.append(send_numbered(producer, 20, 20)))
        sender.start()
        with Admin(broker.url) as admin:  # the failed entry sealed the segment before it
            wait_for(lambda: any(s.state == "CLOSED" for s in admin.list_segments(TOPIC)),
                     what="a write to fail on the full disk")
        filler.unlink()
        sender.join(timeout=scaled(60))
        assert result, "the retried send did not complete"
        producer.close()
        report = check(read_all(broker.url, TOPIC), sends + result)
        assert report.ok and report.acknowledged == 40, str(report)
        broker.stop()


def test_no_batch_is_stored_past_a_failed_one_of_its_producer(data_dir) -> None:
    # Regression: a failed write seals the segment, but batches that the producer's stream
    # had sent after the failed one and that reached the broker after the seal were stored in
    # the next segment. The producer's last stored sequence id then passed the failed batch,
    # whose re-send was acknowledged as a duplicate: acknowledged, never stored (seen once in
    # the test above as "missing writer:30..34").
    from tierstream.broker.config import StoreConfig
    from tierstream.broker.store import Store

    def batch(seq: int) -> pa.RecordBatch:  # more than a page: a full disk fails its write
        return as_produce_batch(pa.record_batch({"value": [f"m{seq}".encode()],
                                                 "key": [f"{seq}" * 10_000]}))

    with _small_disk(data_dir / "bookies" / "bookie-0") as filler, \
            Store(StoreConfig.from_options({"dataDir": str(data_dir)})) as store:
        store.create_topic(TOPIC, 1)
        plog = store.partition(TOPIC, 0)
        for seq in (0, 1):
            plog.append(batch(seq), producer="writer", sequence_id=seq)
        _fill(filler)
        failed = [plog.submit(batch(seq), producer="writer", sequence_id=seq) for seq in (2, 3)]
        for pending in failed:
            with pytest.raises(UnavailableError, match="ack quorum"):
                pending.result()
        filler.unlink()
        # the stream's next batch, read before the stream learnt of the failure
        with pytest.raises(UnavailableError, match=r"sequence id 2 .*failed"):
            plog.append(batch(4), producer="writer", sequence_id=4)
        for seq in (2, 3, 4):  # the producer's re-send, from the failed batch on
            assert not plog.append(batch(seq), producer="writer", sequence_id=seq).duplicate
        stored = pa.Table.from_batches(plog.read(plog.earliest(),
                                                 end=plog.last_confirmed()[1]))
        assert stored.column("value").to_pylist() == [f"m{i}".encode() for i in range(5)]


def test_a_broker_that_stops_answering_is_given_up_on_after_the_send_timeout(start_broker
                                                                              ) -> None:
    # Regression: the producer waited for acks inside a Flight read with no deadline, which
    # no signal interrupts: a broker alive but stuck (here: stopped) held send() forever,
    # past its send_timeout and deaf to Ctrl-C.
    import os
    import signal

    broker = start_broker()
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    producer = Producer(TOPIC, broker=broker.url, name="patient", send_timeout=scaled(30))
    producer.send("before")  # a loaded machine may take its time for this one
    producer.send_timeout = scaled(2)
    stop_process(broker.proc.pid)
    try:
        outcome: list[BaseException | None] = []

        def send() -> None:
            try:
                producer.send("during")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(timeout=scaled(30))
        assert outcome, "send() still waits for a stopped broker, past its send_timeout"
        assert isinstance(outcome[0], UnavailableError), outcome
        assert "connected but sent no ack" in str(outcome[0])
        assert outcome[0].unacknowledged == {0: [1]}  # type: ignore[attr-defined]
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    producer.send_timeout = scaled(30)
    producer.close()  # flushes: the batch in doubt is sent again, and stored once
    assert read_all(broker.url, TOPIC).column("value").to_pylist() == [b"before", b"during"]


def test_a_producer_that_gives_up_names_the_sequence_ids_in_doubt(start_broker,
                                                                  free_port) -> None:
    broker = start_broker(port=free_port)
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 1)
    # a short send timeout to give up quickly while the broker is down (load only makes
    # the give-up later) ...
    producer = Producer(TOPIC, broker=broker.url, name="importer", send_timeout=1.0)
    producer.send("stored")  # sequence id 0
    broker.kill()
    with pytest.raises(UnavailableError, match=r"sequence id\(s\) 1 \(1 message\(s\)\) were "
                                               r"sent but never acknowledged") as info:
        producer.send("in doubt")
    assert info.value.unacknowledged == {0: [1]}  # type: ignore[attr-defined]
    restarted = start_broker(port=free_port)
    # ... and a load-proof one for the re-send: a restarted broker recovers before it
    # answers, which a busy machine stretches past one second
    producer.send_timeout = scaled(30)
    producer.flush()  # still queued: delivered now, once
    producer.close()
    values = read_all(restarted.url, TOPIC).column("value").to_pylist()
    assert values == [b"stored", b"in doubt"]
