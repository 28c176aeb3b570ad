"""A topic's compaction on a cluster: the broker that owns a partition compacts it
(``topics/compaction.py``), so ``topic compact`` (and its status) asked of one broker is
answered by its own compactor for the partitions it serves and by their owners, asked side by
side (``peers.py``), for the others. A partition nobody answered for (its owner down, or it is
moving) is named in the answer's error; the next run, or the owner's threshold policy,
compacts it. A move hands the work over with the partition: the new owner's runs go on from
the snapshot in metadata."""

from __future__ import annotations

import time
from typing import Any, Protocol

from tierstream.errors import TierstreamError
from tierstream.metadata.compactions import compactions_of

__all__ = ["with_owners"]


class _Store(Protocol):
    """What this asks of the broker's store (``broker/store.py``, which sits above)."""

    cluster: Any  # its Cluster (peers), None when not in one
    owners: Any  # its OwnedPartitions view (of_topic)
    metadata: Any  # its MetadataStore

    def partitions(self, topic: str) -> list[Any]: ...

    def topic(self, topic: str) -> Any: ...

_ORDER = ("NOT_RUN", "SUCCESS", "RUNNING", "ERROR")  # the worse state wins
#: how often a ``compact`` that waits asks the other owners whether their runs are done
POLL_S = 0.2


def with_owners(store: _Store, here: dict[str, Any], action: str,
                body: dict[str, Any]) -> dict[str, Any]:
    """``here`` (this broker's answer to ``action``: ``compact`` or ``compaction``) with the
    other owners' answers for the partitions they serve merged in. The others' runs are
    started without waiting (a peer's call is short, a run may not be), then, for a
    ``compact`` that waits, asked after until none is running."""
    cluster = store.cluster
    if cluster is None or body.get("here_only"):
        return here
    name = here["topic"]
    try:
        served = {p.partition for p in store.partitions(name)}
    except TierstreamError:
        served = set()
    owners = store.owners.of_topic(name)
    asked: dict[str, list[int]] = {}
    missing: list[str] = []
    for partition in range(store.topic(name).serving):
        if partition in served:
            continue
        owner = owners.get(partition)
        if owner is None or owner.url is None:
            missing.append(f"partition {partition}: no broker serves it now")
        else:
            asked.setdefault(owner.url, []).append(partition)
    asking = {**body, "topic": name, "here_only": True, "wait": False}
    answers = cluster.peers.call_each({url: (action, asking) for url in asked})
    waits = action == "compact" and body.get("wait", True)
    while waits and (running := [url for url, a in answers.items()
                                 if not isinstance(a, Exception) and a["status"] == "RUNNING"]):
        time.sleep(POLL_S)
        answers.update(cluster.peers.call_each({url: ("compaction", asking) for url in running}))
    out = dict(here)
    out["run"] = {str(k): v for k, v in here.get("run", {}).items()}
    out["backlog_bytes"] = {str(k): v for k, v in here.get("backlog_bytes", {}).items()}
    states, errors = [here["status"]], [here["error"]] if here.get("error") else []
    for url, answer in answers.items():
        if isinstance(answer, Exception):
            missing.append(f"partitions {asked[url]} (at {url}): {answer}")
            continue
        states.append(answer["status"])
        if answer.get("error"):
            errors.append(f"{url}: {answer['error']}")
        for field in ("run", "backlog_bytes"):
            out[field].update({str(k): v for k, v in answer.get(field, {}).items()
                               if int(k) in asked[url]})
        for field, pick in (("started_ms", min), ("finished_ms", max)):
            known = [t for t in (out.get(field), answer.get(field)) if t is not None]
            out[field] = pick(known) if known else None
    if missing and action == "compact":
        states.append("ERROR")
        errors += [f"not compacted: {m}" for m in missing]
    elif missing:
        out["unanswered"] = missing
    if answers:  # what the others' runs registered
        out["snapshots"] = [r.to_dict() for r in compactions_of(store.metadata, name).values()]
    out["status"] = max(states, key=_ORDER.index)
    out["error"] = "; ".join(errors) or None
    return out
