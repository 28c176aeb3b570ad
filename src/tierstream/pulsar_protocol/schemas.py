"""A Pulsar producer's schema as a version of the topic's schema in tierstream's registry.

Pulsar's BYTES is tierstream's bytes (no version); STRING and AVRO are the same types with
the same value encoding (UTF-8; Avro binary without a header). Pulsar's JSON schema is
defined by an Avro record while its values are JSON text: tierstream's JSON type is checked
against a JSON Schema, so the record is translated to the JSON Schema that says the same
(:func:`json_schema_of`) and registered as that; the same record always gives the same JSON
Schema, hence the same version. Other Pulsar schema types are refused by name.

The version travels as Pulsar's schema version: 8 bytes, big-endian (PRODUCER_SUCCESS, and
``schema_version`` in each message's metadata); tierstream records it per message in the
property ``tierstream.schema.version``, as its own producers do.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

from tierstream.errors import ConfigError
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.schemas.model import SchemaType

__all__ = ["SchemaRefused", "json_schema_of", "pulsar_schema", "registered_version",
           "schema_version_bytes", "version_of"]

_TYPES = {api.Schema.String: SchemaType.STRING, api.Schema.Avro: SchemaType.AVRO,
          api.Schema.Json: SchemaType.JSON}

_PRIMITIVE = {"null": {"type": "null"}, "boolean": {"type": "boolean"},
              "int": {"type": "integer"}, "long": {"type": "integer"},
              "float": {"type": "number"}, "double": {"type": "number"},
              "string": {"type": "string"}, "bytes": {"type": "string"}}


class SchemaRefused(ConfigError):
    """A producer's schema that the topic may not take (Pulsar's IncompatibleSchema)."""


def registered_version(registry: Any, topic: str, schema: api.Schema) -> int | None:
    """The topic's version of ``schema`` (registered if new and compatible), None for bytes;
    SchemaRefused naming the reason otherwise."""
    if schema.type == api.Schema.Bytes:
        return None
    kind, text = _definition(schema)
    try:
        return int(registry.register(topic, kind, text).version)
    except ConfigError as exc:
        raise SchemaRefused(str(exc)) from None


def check_consumer_schema(registry: Any, topic: str, schema: api.Schema) -> None:
    """A consumer's schema, as Pulsar's broker checks it: one the topic's rule would take as
    its next version (or one it has) reads the topic; BYTES reads any. SchemaRefused naming
    the reason otherwise. Nothing is registered: only producers add versions."""
    if schema.type == api.Schema.Bytes:
        return
    kind, text = _definition(schema)
    try:
        why = registry.check(topic, kind, text)
    except ConfigError as exc:
        raise SchemaRefused(str(exc)) from None
    if why is not None:
        raise SchemaRefused(f"the consumer's schema cannot read {topic!r}: {why}")


def _definition(schema: api.Schema) -> tuple[SchemaType, str | None]:
    """``schema`` as tierstream's schema type and definition; SchemaRefused for a type
    tierstream does not keep."""
    kind = _TYPES.get(schema.type)
    if kind is None:
        name = _pulsar_name(schema.type)
        raise SchemaRefused(f"{name} schemas are not supported by this tierstream broker: a "
                            "topic's values are BYTES, STRING, AVRO or JSON")
    text = None
    if kind is SchemaType.AVRO:
        text = schema.schema_data.decode("utf-8", "replace")
    elif kind is SchemaType.JSON:
        try:
            record = json.loads(schema.schema_data)
        except ValueError as exc:
            raise SchemaRefused(f"invalid JSON schema: its definition is not an Avro record "
                                f"({exc})") from None
        text = json.dumps(json_schema_of(record))
    return kind, text


def pulsar_schema(info: Any) -> api.Schema:
    """A version of a topic's schema (``SchemaInfo``) as Pulsar's Schema: STRING, AVRO with
    its definition, JSON with the JSON Schema it is checked against."""
    kind = {SchemaType.STRING: api.Schema.String, SchemaType.AVRO: api.Schema.Avro,
            SchemaType.JSON: api.Schema.Json}.get(info.type, api.Schema.Bytes)
    return api.Schema(name=info.topic, type=kind,
                      schema_data=(info.definition or "").encode())


def _pulsar_name(kind: int) -> str:
    """A schema type as Pulsar's admin tools spell it (KEY_VALUE, PROTOBUF_NATIVE...)."""
    if kind not in api.Schema.Type.values():
        return f"schema type {kind}"
    name = api.Schema.Type.Name(kind).replace("KeyValuePair", "KeyValue")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def json_schema_of(avro: Any) -> dict[str, Any]:
    """The JSON Schema that accepts what an Avro schema describes, written as JSON text."""
    return _convert(avro, {})


def _convert(t: Any, names: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(t, str):
        if t in _PRIMITIVE:
            return dict(_PRIMITIVE[t])
        found = names.get(t) or names.get(t.rsplit(".", 1)[-1])
        if found is None:
            raise SchemaRefused(f"invalid JSON schema: unknown Avro type {t!r}")
        return found
    if isinstance(t, list):  # a union: any of its branches
        branches = [_convert(b, names) for b in t]
        if all(set(b) == {"type"} and isinstance(b["type"], str) for b in branches):
            return {"type": [b["type"] for b in branches]}
        return {"anyOf": branches}
    if not isinstance(t, dict) or "type" not in t:
        raise SchemaRefused(f"invalid JSON schema: {json.dumps(t)[:80]} is not an Avro type")
    kind = t["type"]
    if kind == "record":
        out: dict[str, Any] = {"type": "object", "properties": {}}
        if "name" in t:  # a reference inside its own definition: any object
            names[str(t["name"])] = {"type": "object"}
        required = []
        for field in t.get("fields", []):
            out["properties"][field["name"]] = _convert(field["type"], names)
            nullable = isinstance(field["type"], list) and "null" in field["type"]
            if not nullable and "default" not in field:
                required.append(field["name"])
        if required:
            out["required"] = required
        if "name" in t:
            names[str(t["name"])] = out
        return out
    if kind == "array":
        return {"type": "array", "items": _convert(t["items"], names)}
    if kind == "map":
        return {"type": "object", "additionalProperties": _convert(t["values"], names)}
    if kind == "enum":
        return {"type": "string", "enum": list(t.get("symbols", []))}
    if kind == "fixed":
        return {"type": "string"}
    return _convert(kind, names)  # {"type": "long", "logicalType": ...} and the like


def schema_version_bytes(version: int) -> bytes:
    return struct.pack(">q", version)


def version_of(data: bytes) -> int:
    """A Pulsar schema version (8 bytes, big-endian) as tierstream's version number."""
    if len(data) != 8:
        raise ConfigError(f"schema version of {len(data)} bytes: Pulsar's are 8")
    return int(struct.unpack(">q", data)[0])
