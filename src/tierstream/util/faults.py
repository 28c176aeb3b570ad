"""Crash points: the broker kills itself (SIGKILL) at a named step, for crash-point tests;
fault points: a worker thread meets an error nobody expected at a named step; pause points:
a thread sleeps at a crash point's step.

A test arms one point through the environment of the broker process it starts::

    TIERSTREAM_CRASH_AT="roll.metadata-sealed@3"

kills the process the third time the broker passes ``roll.metadata-sealed`` (``@1`` when no
count is given). Nothing is mocked: the process dies as it would from ``kill -9`` at that line,
and what is on disk is exactly what a crash there leaves. Unarmed, a crash point costs one
global lookup.

The points, in the order a write passes them (``tests/store/test_crash_points.py`` kills at each):

``append.partial-replicas``   an entry is on the first bookie of its ensemble, not yet sent to
                              the others (nothing acknowledged)
``append.before-ack``         an entry has its ack quorum; the producer has no ack yet
``roll.bookies-sealed``       rollover: the ledgers are sealed on the bookies, metadata says OPEN
``roll.metadata-sealed``      rollover: the seal (with the producers' de-dup state) is committed
``roll.next-registered``      rollover: the next segment is in metadata, its ledgers not created
``recovery.replica-repaired`` recovery: one replica of a crashed segment was rewritten
``recovery.sealed``           recovery: a crashed segment is sealed in metadata
``cursor.writing``            acks are taken (in memory); their cursors' commit starts now
``cursor.saved``              a subscription's cursor is committed; the ack has no answer yet
``topic.registered``          a new topic is in metadata; its partitions are not open yet
``scale.sealed``              a scale event sealed the topic's open segments; nothing of the
                              event is in metadata
``scale.recorded``            a scale event (new count, event row, new open segments) is
                              committed in metadata; no partition serves the new count yet
``compaction.written``        a compaction snapshot's file is on the tier; metadata still
                              names the previous snapshot
``compaction.saved``          a compaction snapshot is committed in metadata; the file two
                              runs old is not deleted yet
``scale.announced``           a client-routed topic's growth is announced in metadata (its
                              new partitions' open segments with it); none of them serves yet
``topic.delete-marked``       a topic is marked deleted; its data is all still there
``topic.data-deleted``        a deleted topic's ledgers, tier files and table are gone, its
                              metadata records are not
``txn.decided``               a commit is decided (COMMITTED in metadata), nothing applied
``txn.shown-here``            several brokers: a commit's entries are shown in the partitions
                              served here; the owners of the others are not asked yet
``txn.asked``                 several brokers: another broker's question about transactions'
                              entries here (count, show, skip) arrived; nothing looked at yet
``txn.partition-applied``     a commit's rows are in the log for one partition of one
                              transaction (held from readers), not yet for the others
``txn.applied``               a commit is in the log and marked APPLIED; staging not removed
``sink.committed``            the Spark sink's commit of a batch returned from the broker;
                              Spark has not recorded the batch as done (a Python process of
                              the Spark driver dies here, so the query fails and re-runs it)
``consumer.attaching``        a consumer is about to attach to its subscription's dispatcher,
                              found loaded (its partition served here)

A fault point (``TIERSTREAM_FAULT_AT="pulsar.receipt@3"``, the same syntax) raises
:class:`InjectedFault` — a ``RuntimeError``, which no handler expects — in the thread that
passes it, so a test sees what that thread's owner makes of a bug there
(``util/threads.py``):

``pulsar.receipt``            a Pulsar connection's receipt thread, before it answers a SEND
``pulsar.delivery``           a Pulsar consumer's delivery thread, with a batch in hand
``consumer.watch``            a tierstream ``Consumer``'s watcher of the topic's partitions
``consumer.attached``         a consumer's attach (a stream's, a Pulsar subscribe's): the
                              dispatcher took it, its stream has not started

A pause point (``TIERSTREAM_PAUSE_AT="scale.recorded"``, the syntax and points of the crash
points) has the thread that passes it sleep ``TIERSTREAM_PAUSE_S`` seconds (default 3), so that
a test lands another thread's step, or another broker's, in that window.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["ENV", "FAULT_ENV", "FAULT_POINTS", "PAUSE_ENV", "PAUSE_S_ENV", "POINTS",
           "InjectedFault", "crash_point", "fault_point"]

ENV = "TIERSTREAM_CRASH_AT"
FAULT_ENV = "TIERSTREAM_FAULT_AT"
PAUSE_ENV = "TIERSTREAM_PAUSE_AT"
PAUSE_S_ENV = "TIERSTREAM_PAUSE_S"
FAULT_POINTS = frozenset({"pulsar.receipt", "pulsar.delivery", "metadata.heartbeat",
                          "bookie.client.send", "bookie.client.receive", "bookie.client.watch",
                          "bookie.acks", "store.housekeeping", "subscriptions.tick",
                          "cursor.write", "dead_letters.write", "bookie.journal",
                          "consumer.watch", "consumer.attached"})

POINTS = frozenset({
    "append.partial-replicas",
    "append.before-ack",
    "roll.bookies-sealed",
    "roll.metadata-sealed",
    "roll.next-registered",
    "recovery.replica-repaired",
    "recovery.sealed",
    "cursor.writing",
    "cursor.saved",
    "topic.registered",
    "scale.sealed",
    "scale.recorded",
    "compaction.written",
    "compaction.saved",
    "scale.announced",
    "topic.delete-marked",
    "topic.data-deleted",
    "txn.decided",
    "txn.shown-here",
    "txn.asked",
    "txn.asked-to-show",
    "txn.partition-applied",
    "txn.applied",
    "consumer.attaching",
    "sink.committed",
})


def _armed(env: str = ENV, points: frozenset[str] = POINTS) -> tuple[str, int] | None:
    raw = os.environ.get(env)
    if not raw:
        return None
    name, _, count = raw.partition("@")
    if name not in points:
        # A typo would make a crash test pass without ever crashing: refuse it loudly.
        raise SystemExit(f"{env}={raw!r}: unknown point {name!r}; known: {sorted(points)}")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise SystemExit(f"{env}={raw!r}: the count after '@' must be an integer") from None
    return name, n


_ARMED: tuple[str, int] | None = None
_FAULT: tuple[str, int] | None = None
_PAUSE: tuple[str, int] | None = None
_pause_s = 3.0
_passes = {"crashes": 0, "faults": 0, "pauses": 0}
_lock = threading.Lock()


def arm() -> None:
    """Arm the points the environment names: as this module is imported, and again in a
    process forked after its environment was changed (the tests' fork server)."""
    global _ARMED, _FAULT, _PAUSE, _pause_s
    _ARMED, _FAULT, _PAUSE = _armed(), _armed(FAULT_ENV, FAULT_POINTS), _armed(PAUSE_ENV)
    raw = os.environ.get(PAUSE_S_ENV) or "3"
    try:
        _pause_s = float(raw)
    except ValueError:
        raise SystemExit(f"{PAUSE_S_ENV}={raw!r}: expected seconds, a number") from None
    _passes.update(crashes=0, faults=0, pauses=0)


arm()


class InjectedFault(RuntimeError):
    """The error a fault point raises."""


def fault_point(name: str) -> None:
    """Raise :class:`InjectedFault` here if ``name`` is the armed fault point and this is its
    armed pass (once)."""
    if _FAULT is not None and _FAULT[0] == name and _passed(_FAULT, "faults"):
        raise InjectedFault(f"fault point {name} (pass {_FAULT[1]})")


def _passed(armed: tuple[str, int], counter: str) -> bool:
    """Count a pass of the armed point: whether it is the pass it fires at."""
    with _lock:
        _passes[counter] += 1
        return _passes[counter] == armed[1]


def crash_point(name: str, *, before: Callable[[], object] | None = None) -> None:
    """Kill this process here if ``name`` is the armed point and this is its armed pass.

    ``before`` runs first when the point fires (e.g. wait until one replica has the entry), so
    the state on disk at the kill is the one the point's name promises.
    """
    if _PAUSE is not None and _PAUSE[0] == name and _passed(_PAUSE, "pauses"):
        logging.getLogger(__name__).warning("pause point %s: this thread sleeps %g s", name,
                                            _pause_s)  # what a test waits for
        time.sleep(_pause_s)
    if _ARMED is not None and _ARMED[0] == name and _passed(_ARMED, "crashes"):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
