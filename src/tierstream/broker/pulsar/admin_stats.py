"""Pulsar's TopicStats JSON (the admin REST's ``.../stats``, ``admin_http.py``) from
tierstream's topic stats (``broker/stats/topic_stats.py``)."""

from __future__ import annotations

import datetime
from typing import Any

from tierstream.util.timeutil import now_ms

__all__ = ["pulsar_stats"]

_PULSAR_TYPES = {"exclusive": "Exclusive", "failover": "Failover", "shared": "Shared",
                 "key_shared": "Key_Shared"}


def _consumers(shares: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ConsumerStats per consumer name, over its shares of the partitions."""
    out: dict[str, dict[str, Any]] = {}
    for c in shares:
        entry = out.setdefault(c["name"], {"consumerName": c["name"], "unackedMessages": 0,
                                           "availablePermits": 0, "msgOutCounter": 0,
                                           "redeliveredMessages": 0})
        entry["unackedMessages"] += c["unacked"]
        entry["availablePermits"] += c["permits"]
        entry["msgOutCounter"] += c["delivered"]
        entry["redeliveredMessages"] += c["redelivered"]
    return [out[k] for k in sorted(out)]


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat()


def pulsar_stats(raw: dict[str, Any]) -> dict[str, Any]:
    """Pulsar's TopicStats JSON from tierstream's topic stats (``topic_stats.py``) of a topic or
    of one of its partitions (an entry of its ``partitions``)."""
    storage = raw["storage"]
    stored_bytes = sum(loc["bytes"] for loc in storage.values())
    stored_messages = sum(loc["messages"] for loc in storage.values())
    per_message = stored_bytes / stored_messages if stored_messages else 0.0
    rate_in = raw["msg_rate_in"]
    now = now_ms()
    publishers = []
    # a producer waiting for an exclusive hold is counted, not listed, as Pulsar does
    waiting = sum(1 for p in raw["producers"] if p["waiting"])
    for i, p in enumerate(p for p in raw["producers"] if not p["waiting"]):
        seconds = max(0.001, (now - p["since"]) / 1000)
        publishers.append({
            "producerId": i, "producerName": p["name"], "accessMode": p["mode"],
            "msgRateIn": p["messages"] / seconds, "msgThroughputIn": p["bytes"] / seconds,
            "averageMsgSize": p["bytes"] / p["messages"] if p["messages"] else 0.0,
            "connectedSince": _iso(p["since"]), "metadata": {}})
    subscriptions = {}
    for name, sub in raw["subscriptions"].items():
        subscriptions[name] = {
            "type": _PULSAR_TYPES.get(sub["type"], sub["type"]),
            "msgBacklog": sub["backlog"], "backlogSize": int(sub["backlog"] * per_message),
            "unackedMessages": sub["unacked"], "msgDelayed": sub.get("delayed", 0),
            "msgRateExpired": 0.0,
            "isReplicated": False, "consumers": _consumers(sub["shares"]),
        }
    backlog = max((s["msgBacklog"] for s in subscriptions.values()), default=0)
    return {
        "msgRateIn": rate_in, "msgThroughputIn": raw["byte_rate_in"],
        "msgRateOut": raw["msg_rate_out"], "msgThroughputOut": raw["byte_rate_out"],
        "msgInCounter": raw["messages_in"], "bytesInCounter": raw["bytes_in"],
        "msgOutCounter": raw["messages_out"], "bytesOutCounter": raw["bytes_out"],
        "averageMsgSize": raw["byte_rate_in"] / rate_in if rate_in else 0.0,
        "msgChunkPublished": False,
        "storageSize": stored_bytes, "offloadedStorageSize": storage["tier"]["bytes"],
        "backlogSize": int(backlog * per_message),
        "publishers": publishers, "waitingPublishers": waiting,
        "subscriptions": subscriptions, "replication": {},
        "deduplicationStatus": "Enabled",
    }
