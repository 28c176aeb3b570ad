"""Leaving a following read: a tail() loop that breaks, a closed iterator, a closed Consumer.
Each stops its threads and broker streams at once, whatever is (not) arriving."""

from __future__ import annotations

import subprocess
import sys
import threading
import traceback
from pathlib import Path

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset, Position
from tierstream.splits.split import StreamCut

from ..timing import scaled
from .helpers import wait_for

TOPIC = "acme/web/leave"


def _threads(prefix: str, *, besides: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """The names of the running threads named ``prefix``..., but those in ``besides`` (the
    threads of other tests in the same worker process, which share the names)."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith(prefix) and t not in besides]


def _topic(broker: BrokerProcess, partitions: int, messages: int, batch_size: int = 10) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, partitions)
    with Producer(TOPIC, broker=broker.url, batch_size=batch_size) as producer:
        producer.send_many({"value": f"v{i}".encode(), "key": f"k{i}"} for i in range(messages))


def _cut_one_back(broker: BrokerProcess, data_dir: Path) -> StreamCut:
    """The latest cut with partition 0 moved back to its first entry: a tail from it has data
    in partition 0 at once and waits on the broker in every other partition."""
    cut = tierstream.latest_cut(TOPIC, broker=broker.url, data_dir=str(data_dir))
    positions = dict(cut.positions)
    positions[0] = Position(0, positions[0].segment_id, 0, 0)
    return StreamCut.of(TOPIC, positions)


def test_closing_a_local_tail_stops_its_threads_though_nothing_arrives(broker, data_dir
                                                                       ) -> None:
    # Regression: the reader threads waited on the broker until the next message arrived in
    # each partition (here: never).
    _topic(broker, 4, 40)
    others = frozenset(threading.enumerate())  # a read another test left is not this tail's
    it = tierstream.tail(TOPIC, start=_cut_one_back(broker, data_dir), broker=broker.url,
                         data_dir=str(data_dir))
    assert next(it).num_rows > 0
    assert _threads("tierstream-read", besides=others)
    it.close()
    try:
        wait_for(lambda: not _threads("tierstream-read", besides=others), timeout=scaled(10),
                 what="the tail's reader threads to stop")
    except AssertionError:  # seen once in a fresh clone: where each one still is
        frames = sys._current_frames()
        raise AssertionError("\n".join(
            f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident])[-4:])}"
            for t in threading.enumerate()
            if t.name.startswith("tierstream-read") and t not in others
            and t.ident in frames)) from None


def test_a_program_that_breaks_out_of_tail_exits(broker, data_dir) -> None:
    _topic(broker, 4, 40)
    cut = _cut_one_back(broker, data_dir).to_json()
    script = (
        "import tierstream\n"
        f"cut = tierstream.StreamCut.from_json({cut!r})\n"
        f"for batch in tierstream.tail({TOPIC!r}, start=cut, broker={broker.url!r}, "
        f"data_dir={str(data_dir)!r}):\n"
        "    break\n"
        "print('left', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(60))  # the old code never exited: TimeoutExpired
    assert proc.returncode == 0 and "left" in proc.stdout, proc.stderr[-2000:]


def test_closing_a_consumer_with_a_full_buffer_stops_its_pumps(broker) -> None:
    # Regression: pumps blocked on the full buffer; close() waited 5 s per partition and left
    # them stuck.
    _topic(broker, 4, 2000, batch_size=1)
    consumer = Consumer(TOPIC, "leaver", initial=Offset.earliest(), broker=broker.url)
    # the broker sends each consumer one batch per dispatch pass (as many entries as its
    # permits allow): how many batches that makes depends on timing, not on the 2,000
    # messages, so wait for some, not for a number only a slow dispatcher reaches
    wait_for(lambda: consumer.buffered >= 4, timeout=scaled(30),
             what="the consumer's buffer to fill")
    assert len(_threads(f"tierstream-consumer-{consumer.name}-p")) == 4  # + its watcher
    consumer.close()
    assert _threads(f"tierstream-consumer-{consumer.name}") == []
    assert consumer.buffered == 0
