"""One client process of the client-churn stress run (tests/store/client_churn.py).

    python -m tests.store.churn_client KIND BROKER_URL PULSAR_URL TOPIC NAME

``KIND`` is ``ts-consumer-<type>``, ``ts-producer`` or ``ts-tail`` (tierstream's client), or
``pulsar-consumer-<type>`` or ``pulsar-producer`` (the real Pulsar client), ``<type>`` one of
exclusive, failover, shared, key_shared. The process works as an application would —
produces keyed messages, or receives and acknowledges — until SIGTERM (it closes its client)
or SIGKILL (the crash). What it is told by the broker does not matter here: errors while the
broker restarts are waited out or end the process quietly; only the broker's fate is checked.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


def _tierstream(kind: str, url: str, topic: str, name: str, stop: threading.Event) -> None:
    from tierstream.client import Consumer, Producer, read
    from tierstream.errors import TierstreamError
    from tierstream.model.positions import Offset

    if kind == "ts-producer":
        with Producer(topic, broker=url, name=name, batch_size=50) as producer:
            n = 0
            while not stop.is_set():
                producer.send_many({"key": f"key-{(n + i) % 64}", "value": b"v"}
                                   for i in range(50))
                n += 50
        return
    if kind == "ts-tail":
        for _ in read(topic, broker=url, start=Offset.earliest()):  # follows the tail
            if stop.is_set():
                return
        return
    mode = kind.removeprefix("ts-consumer-")
    consumer = Consumer(topic, "churn-" + mode, mode=mode, consumer_name=name, broker=url,
                        initial=Offset.earliest(), receiver_queue_size=100)
    try:
        while not stop.is_set():
            batch = consumer.receive(timeout=0.1)
            if batch is not None:
                # in doubt across a broker restart: the broker is what is checked here
                with contextlib.suppress(TierstreamError):
                    consumer.ack(batch)
    finally:
        consumer.close()


def _pulsar(kind: str, url: str, topic: str, name: str, stop: threading.Event) -> None:
    import pulsar

    client = pulsar.Client(url, operation_timeout_seconds=30,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        if kind == "pulsar-producer":
            producer = client.create_producer(f"persistent://{topic}", producer_name=name,
                                              batching_enabled=True)
            n = 0
            while not stop.is_set():
                for i in range(50):
                    key = f"key-{(n + i) % 64}"
                    producer.send_async(b"v", None, partition_key=key)
                producer.flush()
                n += 50
            producer.close()
            return
        types = {"exclusive": pulsar.ConsumerType.Exclusive,
                 "failover": pulsar.ConsumerType.Failover,
                 "shared": pulsar.ConsumerType.Shared,
                 "key_shared": pulsar.ConsumerType.KeyShared}
        mode = kind.removeprefix("pulsar-consumer-")
        consumer = client.subscribe(f"persistent://{topic}", "churn-pulsar-" + mode,
                                    consumer_type=types[mode], consumer_name=name,
                                    receiver_queue_size=100,
                                    initial_position=pulsar.InitialPosition.Earliest)
        while not stop.is_set():
            try:
                msg = consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            consumer.acknowledge(msg)
        consumer.close()
    finally:
        client.close()


def main() -> None:
    kind, url, pulsar_url, topic, name = sys.argv[1:6]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if kind.startswith("pulsar-"):
            _pulsar(kind, pulsar_url, topic, name, stop)
        else:
            _tierstream(kind, url, topic, name, stop)
    except Exception:  # a client refused or cut off: the broker is what is checked
        sys.exit(3)


if __name__ == "__main__":
    main()
