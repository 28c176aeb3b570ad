"""A real Pulsar client consumer process for the subscription chaos runs with Pulsar clients
(``tests/store/subscription_chaos.py --client pulsar``).

    python -m tests.pulsar_wire.pulsar_worker PULSAR_URL TOPIC SUBSCRIPTION MODE NAME LOG

Logs as ``tests/store/subscription_worker.py`` does, one message at a time: its receipt
(value ``key|index``, redelivery count, message id) and the start of its ack, flushed
*before* the ack, then the ack's end. The Python client's ``acknowledge`` returns once the
ack is queued (grouped, sent within 100 ms; there are no ack receipts), so the checker lets
an ack that returned just before a crash be lost (see ``_check``). SIGTERM closes the
consumer, which sends its pending acks first; SIGKILL is the crash.

Batch-index acks are on, so every ``acknowledge`` reaches the broker. Without them the client
acknowledges a batch only once every message of it is (as Pulsar's clients do): a consumer
closed with part of a batch still in its receiver queue has sent no ack for the part it
acknowledged, and the whole batch goes to another consumer — a redelivery after an ack that
the checker would rightly count, though no broker could avoid it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import pulsar

TYPES = {"key_shared": pulsar.ConsumerType.KeyShared, "shared": pulsar.ConsumerType.Shared}


def main() -> None:
    url, topic, subscription, mode, name, log_path = sys.argv[1:7]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = pulsar.Client(url, operation_timeout_seconds=120,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    consumer = client.subscribe(f"persistent://{topic}", subscription,
                                consumer_type=TYPES[mode], consumer_name=name,
                                receiver_queue_size=200, batch_index_ack_enabled=True,
                                initial_position=pulsar.InitialPosition.Earliest)
    print("ready", flush=True)
    with open(log_path, "a") as log:
        while not stop.is_set():
            try:
                msg = consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            got = time.monotonic()
            value = msg.data().decode()
            log.write(json.dumps({"e": "r", "t": got, "c": name,
                                  "m": [[value, msg.redelivery_count(),
                                         str(msg.message_id())]]}) + "\n")
            start = time.monotonic()
            log.write(json.dumps({"e": "s", "t": start, "c": name, "m": [value]}) + "\n")
            log.flush()
            consumer.acknowledge(msg)
            log.write(json.dumps({"e": "a", "t0": start, "t1": time.monotonic(), "c": name,
                                  "m": [value]}) + "\n")
    consumer.close()
    client.close()


if __name__ == "__main__":
    main()
