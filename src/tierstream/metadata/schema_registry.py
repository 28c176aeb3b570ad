"""The schema registry of the store: versions of each topic's schema and its compatibility
rule, in the metadata store (tables ``schemas`` and ``schema_policies``).

A new version is added only if it is compatible with the existing ones under the topic's
rule (schemas/compat.py); registering a schema whose fingerprint is already a version of the
topic returns that version (producers register on every start).
"""

from __future__ import annotations

import json

from tierstream.errors import ConfigError, NotFoundError
from tierstream.metadata.store import MetadataStore
from tierstream.model.names import TopicName
from tierstream.schemas.compat import check_new_version
from tierstream.schemas.model import (
    DEFAULT_COMPATIBILITY,
    VERSION_PROPERTY,
    Compatibility,
    SchemaInfo,
    SchemaType,
    canonical,
)
from tierstream.util.timeutil import now_ms

__all__ = ["SchemaRegistry"]

_COLUMNS = "topic, version, type, definition, fingerprint, created_at"


class SchemaRegistry:
    """Schemas of the topics of one metadata store."""

    def __init__(self, metadata: MetadataStore) -> None:
        self._meta = metadata
        self._known: dict[str, set[str]] = {}  # topic -> its version numbers, as text
        self._read: dict[str, list[SchemaInfo]] = {}  # topic -> its versions, as last read

    def check_named_versions(self, topic: str, named: set[str]) -> None:
        """Refuse a batch whose messages name (property ``tierstream.schema.version``) a
        version ``topic`` does not have: readers would decode it with the wrong schema or
        none. Versions only grow, so the known ones are cached and re-read on a miss."""
        if not named:
            return
        known = self._known.get(topic)
        if known is None or not named <= known:
            known = self._known[topic] = {str(v.version) for v in self.versions(topic)}
        stray = sorted(named - known)
        if stray:
            has = f"versions 1..{max(map(int, known))}" if known else "no schema"
            raise ConfigError(
                f"message property {VERSION_PROPERTY!r} = {stray[0]!r} names no schema version "
                f"of topic {topic!r} (it has {has}); the property is set by tierstream when it "
                "encodes a value: send values through a producer or transaction of the topic, "
                "without that property")

    def forget(self, topic: str) -> None:
        """The topic was deleted: a topic made again with its name starts with no versions."""
        self._known.pop(topic, None)
        self._read.pop(topic, None)

    def _topic(self, topic: str) -> str:
        return str(self._meta.get_topic(TopicName.parse(topic)).name)  # exists, or NotFound

    def versions(self, topic: str) -> list[SchemaInfo]:
        """The topic's versions, oldest first; while the metadata store cannot be reached,
        the last ones read here (versions only grow, and a new one needs the store), so a
        producer or consumer opening meanwhile is answered rather than made to wait."""
        known = self._read.get(topic)
        if known is not None and self._meta.backend.unreachable.is_set():
            return list(known)
        versions = self._read[topic] = self._meta.schema_versions(topic)
        return list(versions)

    def get(self, topic: str, version: int | None = None) -> SchemaInfo:
        versions = self.versions(topic)
        if not versions:
            raise NotFoundError(f"topic {topic!r} has no schema (its values are bytes)")
        if version is None:
            return versions[-1]
        for info in versions:
            if info.version == version:
                return info
        raise NotFoundError(f"topic {topic!r} has no schema version {version}; it has "
                            f"1..{versions[-1].version}")

    def compatibility(self, topic: str) -> Compatibility:
        name = self._topic(topic)
        rows = self._meta.query("SELECT compatibility FROM schema_policies WHERE topic=?",
                                (name,))
        return Compatibility(rows[0][0]) if rows else DEFAULT_COMPATIBILITY

    def set_compatibility(self, topic: str, rule: Compatibility) -> None:
        name = self._topic(topic)
        with self._meta.atomic() as c:
            c.execute("INSERT INTO schema_policies (topic, compatibility) VALUES (?,?) "
                      "ON CONFLICT (topic) DO UPDATE SET compatibility=excluded.compatibility",
                      (name, rule.value))

    def check(self, topic: str, type_: SchemaType, text: str | None) -> str | None:
        """Why this schema may not be the topic's next version, or None."""
        definition, fingerprint = canonical(type_, text)
        versions = self.versions(topic)
        if any(v.fingerprint == fingerprint for v in versions):
            return None
        return check_new_version(type_, json.loads(definition) if definition else None,
                                 versions, self.compatibility(topic), topic)

    def register(self, topic: str, type_: SchemaType, text: str | None) -> SchemaInfo:
        """The version of this schema: an existing one with the same fingerprint, or a new
        one if it is compatible (ConfigError naming the field and the rule otherwise).
        While the metadata store cannot be reached, an existing version last read here is
        answered (a producer registers at every start)."""
        definition, fingerprint = canonical(type_, text)
        if self._meta.backend.unreachable.is_set():
            same = next((v for v in self._read.get(topic, []) if v.fingerprint == fingerprint),
                        None)
            if same is not None:
                return same
        name = self._topic(topic)
        with self._meta.atomic() as c:  # check and insert in one transaction
            rows = c.execute(f"SELECT {_COLUMNS} FROM schemas WHERE topic=? ORDER BY version",
                             (name,)).fetchall()
            versions = [SchemaInfo(t, v, SchemaType(ty), d, f, cr) for t, v, ty, d, f, cr
                        in rows]
            same = next((v for v in versions if v.fingerprint == fingerprint), None)
            if same is not None:
                return same
            rule = self.compatibility(name)
            why = check_new_version(type_, json.loads(definition) if definition else None,
                                    versions, rule, name)
            if why is not None:
                raise ConfigError(f"incompatible schema for {name!r}: {why}")
            info = SchemaInfo(name, (versions[-1].version if versions else 0) + 1, type_,
                              definition, fingerprint, now_ms())
            c.execute(f"INSERT INTO schemas ({_COLUMNS}) VALUES (?,?,?,?,?,?)",
                      (info.topic, info.version, info.type.value, info.definition,
                       info.fingerprint, info.created_at))
        self._read[name] = [*versions, info]
        if topic != name:
            self._read.pop(topic, None)
        return info
