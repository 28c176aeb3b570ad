"""A consumer process for the subscription chaos runs (tests/store/subscription_chaos.py).

    python -m tests.store.subscription_worker URL TOPIC SUBSCRIPTION MODE NAME LOG

Receives batches, writes each to ``LOG`` (one JSON line: receive time and the messages'
``key|index`` values with their redelivery counts and positions) *before* acknowledging it,
then writes that the ack starts, acks, and writes its start and end times: as ``a`` when
the ack returned, as ``d`` when it raised AckInDoubtError (stored, but a broker restart may
have had the messages sent to another consumer first). SIGTERM closes the
consumer (what it holds goes to the others); SIGKILL is the crash. The monotonic clock is the
machine's, so the lines of all workers can be merged in time.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from tierstream.client import Consumer
from tierstream.errors import AckInDoubtError
from tierstream.model.positions import Offset


def main() -> None:
    url, topic, subscription, mode, name, log_path = sys.argv[1:7]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    consumer = Consumer(topic, subscription, mode=mode, consumer_name=name, broker=url,
                        initial=Offset.earliest(), receiver_queue_size=200)
    print("ready", flush=True)
    with open(log_path, "a") as log:
        while not stop.is_set():
            batch = consumer.receive(timeout=0.1)
            if batch is None:
                continue
            got = time.monotonic()
            values = [v.decode() for v in batch.column("value").to_pylist()]
            counts = batch.column("redelivery_count").to_pylist()
            where = [f"{p}:{s}:{e}:{b}" for p, s, e, b in zip(
                *(batch.column(c).to_pylist() for c in ("partition", "segment_id", "entry_id",
                                                        "batch_index")), strict=True)]
            log.write(json.dumps({"e": "r", "t": got, "c": name,
                                  "m": [[v, n, w] for v, n, w in zip(values, counts, where,
                                                                     strict=True)]})
                      + "\n")
            start = time.monotonic()  # logged first: a kill may end the ack midway
            log.write(json.dumps({"e": "s", "t": start, "c": name, "m": values}) + "\n")
            log.flush()
            event = "a"
            try:
                consumer.ack(batch)
            except AckInDoubtError:  # stored, but others may have been sent these meanwhile
                event = "d"
            log.write(json.dumps({"e": event, "t0": start, "t1": time.monotonic(), "c": name,
                                  "m": values}) + "\n")
            log.flush()
    consumer.close()


if __name__ == "__main__":
    main()
