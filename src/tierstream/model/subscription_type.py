"""The four subscription types, named as in Pulsar (what each guarantees:
broker/subscriptions/selectors.py and docs/subscriptions.md)."""

from __future__ import annotations

from tierstream.errors import ConfigError

__all__ = ["SubscriptionType"]


class SubscriptionType:
    EXCLUSIVE = "exclusive"
    FAILOVER = "failover"
    SHARED = "shared"
    KEY_SHARED = "key_shared"
    ALL = (EXCLUSIVE, FAILOVER, SHARED, KEY_SHARED)
    #: types whose acks may be cumulative (one consumer reads a partition in order)
    CUMULATIVE = (EXCLUSIVE, FAILOVER)

    @classmethod
    def parse(cls, text: str, what: str = "subscription type") -> str:
        value = str(text).strip().lower().replace("-", "_")
        if value not in cls.ALL:
            raise ConfigError(f"invalid {what} {text!r}: expected one of {', '.join(cls.ALL)}")
        return value
