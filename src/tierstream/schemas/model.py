"""What a topic schema is: a type (NONE, STRING, JSON, AVRO), a definition, a fingerprint,
and the compatibility rules as Pulsar names them.

A definition is kept in a canonical form (JSON with sorted keys and no spaces, Avro through
fastavro's parser first), so the same schema written two ways has one fingerprint: the
SHA-256 of the type and the canonical text. Version numbers start at 1 per topic; messages
written without a schema are version 0 (NONE: bytes).
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tierstream.errors import ConfigError

__all__ = ["MODES", "Compatibility", "SchemaInfo", "SchemaType", "canonical", "parse_definition"]

#: The message property that records the schema version a value was written with.
VERSION_PROPERTY = "tierstream.schema.version"

#: What a read with valueFormat=auto does with a value it cannot decode (option ``mode``).
MODES = ("FAILFAST", "PERMISSIVE", "DROPMALFORMED")


class SchemaType(enum.Enum):
    NONE = "NONE"      # bytes, as before schemas
    STRING = "STRING"  # UTF-8 text
    JSON = "JSON"      # a JSON document, checked against a JSON Schema
    AVRO = "AVRO"      # Avro binary of an Avro schema

    @classmethod
    def parse(cls, text: str) -> SchemaType:
        try:
            return cls(str(text).strip().upper())
        except ValueError:
            raise ConfigError(f"invalid schema type {text!r}: expected one of "
                              f"{', '.join(t.value.lower() for t in cls)}") from None


class Compatibility(enum.Enum):
    """Which versions a new schema must be compatible with, and how (Pulsar's names)."""

    ALWAYS_COMPATIBLE = "ALWAYS_COMPATIBLE"
    ALWAYS_INCOMPATIBLE = "ALWAYS_INCOMPATIBLE"
    BACKWARD = "BACKWARD"  # the new schema reads data written with the last one
    FORWARD = "FORWARD"    # the last schema reads data written with the new one
    FULL = "FULL"          # both
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"  # ... with every earlier version
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"

    @classmethod
    def parse(cls, text: str) -> Compatibility:
        try:
            return cls(str(text).strip().upper().replace("-", "_"))
        except ValueError:
            raise ConfigError(f"invalid compatibility {text!r}: expected one of "
                              f"{', '.join(c.value for c in cls)}") from None

    @property
    def transitive(self) -> bool:
        return self.value.endswith("_TRANSITIVE")

    @property
    def backward(self) -> bool:
        return self.value.startswith(("BACKWARD", "FULL"))

    @property
    def forward(self) -> bool:
        return self.value.startswith(("FORWARD", "FULL"))


DEFAULT_COMPATIBILITY = Compatibility.BACKWARD


@dataclass(frozen=True)
class SchemaInfo:
    """One version of a topic's schema."""

    topic: str
    version: int
    type: SchemaType
    definition: str  # canonical text ('' for NONE and STRING)
    fingerprint: str
    created_at: int

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "version": self.version, "type": self.type.value,
                "definition": self.definition, "fingerprint": self.fingerprint,
                "created_at": self.created_at}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchemaInfo:
        return cls(d["topic"], int(d["version"]), SchemaType.parse(d["type"]),
                   d["definition"], d["fingerprint"], int(d["created_at"]))

    @property
    def parsed(self) -> Any:
        """The definition as a JSON value (None for NONE and STRING)."""
        return json.loads(self.definition) if self.definition else None


def parse_definition(type_: SchemaType, text: str | None) -> Any:
    """The definition of a schema of ``type_`` as a checked JSON value; ConfigError naming
    what is wrong otherwise."""
    if type_ in (SchemaType.NONE, SchemaType.STRING):
        if text and text.strip():
            raise ConfigError(f"a {type_.value} schema has no definition; give none")
        return None
    if not text or not text.strip():
        raise ConfigError(f"a {type_.value} schema needs a definition (--file)")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"invalid {type_.value} schema: not JSON ({exc})") from None
    if type_ is SchemaType.AVRO:
        import fastavro

        try:
            fastavro.parse_schema(value)
        except Exception as exc:  # fastavro raises several types: say what it said
            raise ConfigError(f"invalid Avro schema: {exc}") from None
    else:
        import jsonschema

        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise ConfigError(f"invalid JSON Schema: {exc.message}") from None
        except Exception as exc:
            raise ConfigError(f"invalid JSON Schema: {exc}") from None
    return value


def canonical(type_: SchemaType, text: str | None) -> tuple[str, str]:
    """(canonical definition, fingerprint) of a schema."""
    value = parse_definition(type_, text)
    body = "" if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(f"{type_.value}\n{body}".encode()).hexdigest()
    return body, digest
