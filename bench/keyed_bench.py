"""What keys cost the broker: CPU per message to produce and to consume (individual acks) when
each batch of 1,000 holds 1,000 distinct keys, beside the same messages without keys, in one
run. Keys are per-message work on the broker (their Key_Shared hash, the acks located entry
by entry), so this is where a per-key Python call shows first."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.harness import ProcessCpu, cost_figures, loop_unit_us, report, sized
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Consumer, Producer
from tierstream.model.positions import Offset

VALUE = b"v" * 100
BATCH = 1000


def _run(broker: BrokerProcess, topic: str, messages: int, keys: int | None
         ) -> tuple[ProcessCpu, ProcessCpu]:
    """Produce ``messages`` (``keys`` distinct keys, None: no key) and consume them all,
    acknowledging each batch: the CPU of each half."""
    assert broker.url is not None and broker.proc is not None
    with Admin(broker.url) as admin:
        admin.create_topic(topic, 1)
    rows = [{"key": None if keys is None else f"user-{i % keys}", "value": VALUE}
            for i in range(messages)]
    with Producer(topic, broker=broker.url, batch_size=BATCH, max_in_flight=16) as producer, \
            ProcessCpu(broker.proc.pid) as produced:
        producer.send_many(rows)
    got = 0
    with Consumer(topic, "bench", broker=broker.url, initial=Offset.earliest()) as consumer, \
            ProcessCpu(broker.proc.pid) as consumed:
        while got < messages:
            batch = consumer.receive(timeout=60)
            if batch is None:
                raise RuntimeError(f"{topic}: {got} of {messages} consumed, then nothing")
            got += batch.num_rows
            consumer.ack(batch)
    return produced, consumed


def keyed(quick: bool = True) -> Path:
    messages, runs = sized((200_000, 3) if quick else (1_000_000, 5), (2_000, 1))
    unit = loop_unit_us()
    cost: dict[str, list[tuple[ProcessCpu, ProcessCpu]]] = {"keyed": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data").start()
        try:
            for run in range(runs):  # interleaved, so that both see the same machine
                cost["keyed"].append(_run(broker, f"bench/keyed/k{run}", messages, BATCH))
                cost["plain"].append(_run(broker, f"bench/keyed/p{run}", messages, None))
        finally:
            broker.stop()
    figures = []
    for side, what in ((0, "produce"), (1, "consume, acknowledging each batch")):
        figures += cost_figures(
            f"{what}, {BATCH:,} distinct keys per batch of {BATCH:,}", messages,
            [c[side] for c in cost["keyed"]], unit,
            baseline=("the same messages without keys", [c[side] for c in cost["plain"]]))
    return report("keyed", figures, {"messages": messages, "runs": runs, "batch": BATCH,
                                     "value_bytes": len(VALUE)})
