"""Who may produce to a partition: Pulsar's producer access modes (PIP-68), for every producer.

A producer asks for one of four modes, per partition (a partitioned producer asks for each):

- **Shared** (the default, and every tierstream ``Producer``): any number of them, unless an
  exclusive producer holds the partition or waits for it (``ProducerBusyError``).
- **Exclusive**: the partition's only producer, or refused at once (``ProducerFencedError``)
  while any other producer is attached.
- **WaitForExclusive**: the same, but queued while others are attached: granted, in the order
  asked, when the last of them leaves (its client's create call waits until then).
- **ExclusiveWithFencing**: takes the partition over: every attached producer is fenced (a
  Pulsar client is sent CLOSE_PRODUCER, a tierstream producer's next batch is refused) and
  every queued one refused.

Each grant of exclusivity moves the partition's **topic epoch** on; the exclusive producer is
told it and gives it back when it reconnects (after a broker restart, a lost connection), and
one whose epoch the partition has moved past — someone else held it in between — is fenced
for good. The epochs are kept in the metadata store (``metadata/producer_epochs.py``), each
before its producer is told, so this holds across broker restarts and takeovers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tierstream.errors import (
    ProducerBusyError,
    ProducerFencedError,
    TierstreamError,
    UnavailableError,
)

__all__ = ["EXCLUSIVE", "EXCLUSIVE_WITH_FENCING", "MODES", "SHARED", "WAIT_FOR_EXCLUSIVE",
           "Epochs", "Grant", "ProducerAccess"]

SHARED, EXCLUSIVE, WAIT_FOR_EXCLUSIVE, EXCLUSIVE_WITH_FENCING = 0, 1, 2, 3
#: Pulsar's names of the modes (``CommandProducer.producer_access_mode``)
MODES = {SHARED: "Shared", EXCLUSIVE: "Exclusive", WAIT_FOR_EXCLUSIVE: "WaitForExclusive",
         EXCLUSIVE_WITH_FENCING: "ExclusiveWithFencing"}


@dataclass(frozen=True)
class Grant:
    """What a producer was given: ``ready`` False means queued (WaitForExclusive) until its
    ``ready`` callback is called; ``epoch`` is the topic epoch of an exclusive producer."""

    ready: bool
    epoch: int | None = None


@dataclass
class _Attached:
    name: str | None
    fence: Callable[[str], None] | None


@dataclass
class _Waiting:
    key: int
    name: str | None
    epoch: int | None
    fence: Callable[[str], None] | None
    ready: Callable[[int], None]
    fail: Callable[[TierstreamError], None]


@dataclass
class _Partition:
    attached: dict[int, _Attached] = field(default_factory=dict)
    exclusive: int | None = None  # the key of the producer that holds it exclusively
    waiting: deque[_Waiting] = field(default_factory=deque)
    epoch: int = -1  # -1: never held exclusively
    loaded: bool = False  # its epoch was read from the metadata


class Epochs(Protocol):
    """Where the topic epochs are kept across broker restarts (the metadata store)."""

    def load(self, topic: str, partition: int) -> int: ...  # -1: never held

    def save(self, topic: str, partition: int, epoch: int) -> None: ...


class ProducerAccess:
    """The access of every producer of the broker, keyed by its stream key (``Streams``).
    Callbacks (fence, ready, fail) are called outside the lock, possibly from the thread of
    another producer's request."""

    def __init__(self, epochs: Epochs | None = None) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._epochs = epochs

    def attach(self, topic: str, partition: int, key: int, name: str | None, *,
               mode: int = SHARED, epoch: int | None = None,
               fence: Callable[[str], None] | None = None,
               ready: Callable[[int], None] | None = None,
               fail: Callable[[TierstreamError], None] | None = None) -> Grant:
        """Attach producer ``key`` (named ``name``) in ``mode``, with the topic ``epoch`` its
        client last had, if any; ``fence`` is how to stop it when another producer fences it,
        ``ready``/``fail`` how to answer it later if it waits. Raises ProducerBusyError or
        ProducerFencedError."""
        if mode not in MODES:
            raise ProducerBusyError(f"unknown producer access mode {mode}")
        stored = None  # read outside the lock: a shared producer never waits on the database
        if mode != SHARED and self._epochs is not None and not self._loaded(topic, partition):
            stored = self._epochs.load(topic, partition)
        callbacks: list[Callable[[], None]] = []
        granted: int | None = None
        try:
            with self._lock:
                part = self._partitions.setdefault((topic, partition), _Partition())
                if stored is not None and not part.loaded:
                    part.epoch, part.loaded = max(part.epoch, stored), True
                holder = self._holder(part)
                if mode == SHARED:
                    if part.exclusive is not None or part.waiting:
                        raise ProducerBusyError(
                            f"{_where(topic, partition)} has an exclusive producer"
                            f"{holder}: a shared producer must wait until it leaves")
                    part.attached[key] = _Attached(name, fence)
                    return Grant(ready=True)
                # a client that had the partition before another did is fenced for good:
                # first, so that it neither waits in vain nor fences the one that holds it
                self._check_epoch(part, topic, partition, epoch)
                if mode == EXCLUSIVE_WITH_FENCING:
                    callbacks = self._fence_all(part, topic, partition, name)
                elif mode == EXCLUSIVE and (part.exclusive is not None or part.waiting):
                    raise ProducerFencedError(
                        f"{_where(topic, partition)} has an exclusive producer{holder}")
                elif mode == EXCLUSIVE and part.attached:
                    raise ProducerFencedError(
                        f"{_where(topic, partition)} has {len(part.attached)} shared "
                        "producer(s) attached: an Exclusive producer needs it to itself")
                elif mode == WAIT_FOR_EXCLUSIVE and (part.attached or part.waiting):
                    if ready is None or fail is None:
                        raise ProducerBusyError("a waiting producer needs ready and fail")
                    part.waiting.append(_Waiting(key, name, epoch, fence, ready, fail))
                    return Grant(ready=False)
                granted = self._grant(part, topic, partition, key, name, epoch, fence)
        finally:
            for call in callbacks:
                call()
        self._save(topic, partition, key, granted)
        return Grant(ready=True, epoch=granted)

    def detach(self, key: int, topic: str, partition: int) -> None:
        """Producer ``key`` left (closed, its connection gone, fenced): the next waiting
        producer is granted the partition if it is free now."""
        callbacks: list[Callable[[], None]] = []
        grants: list[tuple[_Waiting, int]] = []
        with self._lock:
            part = self._partitions.get((topic, partition))
            if part is None:
                return
            part.attached.pop(key, None)
            part.waiting = deque(w for w in part.waiting if w.key != key)
            if part.exclusive == key:
                part.exclusive = None
            while part.waiting and not part.attached:
                nxt = part.waiting.popleft()
                try:
                    granted = self._grant(part, topic, partition, nxt.key, nxt.name, nxt.epoch,
                                          nxt.fence)
                except ProducerFencedError as exc:
                    callbacks.append(lambda w=nxt, e=exc: w.fail(e))  # type: ignore[misc]
                    continue
                grants.append((nxt, granted))
            if not part.attached and not part.waiting and part.epoch < 0 and not part.loaded:
                del self._partitions[(topic, partition)]
        for call in callbacks:
            call()
        for waiter, granted in grants:
            try:
                self._save(topic, partition, waiter.key, granted)
            except UnavailableError as exc:
                waiter.fail(exc)
                continue
            waiter.ready(granted)

    def waiting(self) -> set[int]:
        """The keys of the producers that wait for a partition (WaitForExclusive)."""
        with self._lock:
            return {w.key for part in self._partitions.values() for w in part.waiting}

    def _loaded(self, topic: str, partition: int) -> bool:
        with self._lock:
            part = self._partitions.get((topic, partition))
            return part is not None and part.loaded

    def _save(self, topic: str, partition: int, key: int, epoch: int | None) -> None:
        """Keep a granted epoch before the producer is told it; if it cannot be kept, the
        grant is undone (the producer is refused, and its client tries again)."""
        if epoch is None or self._epochs is None:
            return
        try:
            self._epochs.save(topic, partition, epoch)
        except Exception as exc:
            with self._lock:
                part = self._partitions.get((topic, partition))
                if part is not None and part.exclusive == key:
                    part.exclusive = None
                    part.attached.pop(key, None)
            raise UnavailableError(f"the topic epoch of {_where(topic, partition)} could not "
                                   f"be kept in the metadata store: {exc}") from exc

    def _grant(self, part: _Partition, topic: str, partition: int, key: int, name: str | None,
               epoch: int | None, fence: Callable[[str], None] | None) -> int:
        self._check_epoch(part, topic, partition, epoch)
        part.epoch = epoch if epoch is not None else part.epoch + 1  # (checked: not older)
        part.exclusive = key
        part.attached[key] = _Attached(name, fence)
        return part.epoch

    @staticmethod
    def _check_epoch(part: _Partition, topic: str, partition: int, epoch: int | None) -> None:
        if epoch is not None and epoch < part.epoch:
            raise ProducerFencedError(
                f"{_where(topic, partition)} was held by another exclusive producer since "
                f"this one (topic epoch {part.epoch}, the producer's {epoch}): it is fenced")

    def _fence_all(self, part: _Partition, topic: str, partition: int, name: str | None
                   ) -> list[Callable[[], None]]:
        """ExclusiveWithFencing: every attached producer fenced, every waiting one refused."""
        reason = (f"fenced: producer {name or '(unnamed)'} took {_where(topic, partition)} "
                  "with ExclusiveWithFencing")
        calls: list[Callable[[], None]] = []
        for attached in part.attached.values():
            if attached.fence is not None:
                calls.append(lambda f=attached.fence: f(reason))  # type: ignore[misc]
        for waiting in part.waiting:
            calls.append(lambda w=waiting: w.fail(ProducerFencedError(reason)))  # type: ignore[misc]
        part.attached.clear()
        part.waiting.clear()
        part.exclusive = None
        return calls

    def _holder(self, part: _Partition) -> str:
        if part.exclusive is None:
            return " waiting" if part.waiting else ""
        attached = part.attached.get(part.exclusive)
        return f" ({attached.name})" if attached is not None and attached.name else ""


def _where(topic: str, partition: int) -> str:
    return f"{topic} partition {partition}"
