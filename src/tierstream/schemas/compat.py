"""Schema compatibility: can data written with one schema be read with another, and does a new
version satisfy a topic's rule (model.Compatibility)?

Avro follows the specification's schema resolution: named types (record, enum, fixed) match
by unqualified name or one of the reader's aliases (a writer's aliases count for nothing); a
reader's record field missing from the writer (by name or one of the reader field's aliases)
needs a default; a writer's field missing from the reader is skipped; int -> long ->
float -> double and string <-> bytes promote; an enum reader needs every writer symbol (or a
default); union branches resolve branch by branch. JSON Schema is checked on what decoding
needs: a reader requiring a property the writer does not require cannot read every old
document, and a property whose ``type`` changed cannot be read either way. STRING and NONE are
compatible with themselves; a change of type is incompatible.

Each refusal names the field and says why, e.g. ``field 'price' (added in the new schema)
has no default``.
"""

from __future__ import annotations

from typing import Any

from tierstream.schemas.model import Compatibility, SchemaInfo, SchemaType

__all__ = ["can_read", "check_new_version"]

_PROMOTIONS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "double": {"double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
}
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


def check_new_version(type_: SchemaType, definition: Any, existing: list[SchemaInfo],
                      rule: Compatibility, topic: str) -> str | None:
    """Why ``definition`` may not become the next version under ``rule``, or None."""
    if not existing or rule is Compatibility.ALWAYS_COMPATIBLE:
        return None
    latest = existing[-1]
    if rule is Compatibility.ALWAYS_INCOMPATIBLE:
        return (f"topic {topic!r} has compatibility ALWAYS_INCOMPATIBLE: its schema "
                f"(version {latest.version}) cannot change")
    against = existing if rule.transitive else [latest]
    for old in reversed(against):
        if old.type is not type_:
            return (f"the new schema is {type_.value}, version {old.version} is "
                    f"{old.type.value}: a change of type is incompatible under {rule.value}")
        if rule.backward:
            why = can_read(type_, definition, old.parsed)
            if why is not None:
                return (f"under {rule.value} the new schema must read data written with "
                        f"version {old.version}, but {why}")
        if rule.forward:
            why = can_read(type_, old.parsed, definition)
            if why is not None:
                return (f"under {rule.value} version {old.version} must read data written "
                        f"with the new schema, but {why}")
    return None


def can_read(type_: SchemaType, reader: Any, writer: Any) -> str | None:
    """None if data written with ``writer`` decodes with ``reader``, else why not."""
    if type_ is SchemaType.AVRO:
        return _avro(reader, writer, "", _names(reader, {}), _names(writer, {}))
    if type_ is SchemaType.JSON:
        return _json(reader, writer, "")
    return None


# -- Avro ------------------------------------------------------------------------------------

def _names(schema: Any, out: dict[str, Any], namespace: str = "") -> dict[str, Any]:
    """Every named type (record, enum, fixed) by short and full name."""
    if isinstance(schema, list):
        for s in schema:
            _names(s, out, namespace)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            name = schema["name"]
            ns = schema.get("namespace", namespace)
            full = name if "." in name or not ns else f"{ns}.{name}"
            out[full] = out[full.rsplit(".", 1)[-1]] = schema
            namespace = full.rsplit(".", 1)[0] if "." in full else ns
            for f in schema.get("fields", []):
                _names(f["type"], out, namespace)
        elif kind == "array":
            _names(schema["items"], out, namespace)
        elif kind == "map":
            _names(schema["values"], out, namespace)
        else:
            _names(kind, out, namespace)
    return out


def _resolve(schema: Any, names: dict[str, Any]) -> Any:
    if isinstance(schema, str) and schema not in _PRIMITIVES:
        return names.get(schema, names.get(schema.rsplit(".", 1)[-1], schema))
    if isinstance(schema, dict) and schema.get("type") in _PRIMITIVES and \
            len(schema) == 1:
        return schema["type"]
    if isinstance(schema, dict) and isinstance(schema.get("type"), (dict, list)):
        return _resolve(schema["type"], names)
    return schema


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, str):
        return schema
    kind = schema.get("type")
    if isinstance(kind, str) and kind in _PRIMITIVES:
        return kind  # a primitive with attributes, e.g. a logical type
    return "record" if kind == "error" else str(kind)


def _where(path: str) -> str:
    return f"field {path!r}" if path else "the value"


def _avro(reader: Any, writer: Any, path: str, rn: dict[str, Any], wn: dict[str, Any]
          ) -> str | None:
    reader, writer = _resolve(reader, rn), _resolve(writer, wn)
    rk, wk = _kind(reader), _kind(writer)
    if wk == "union":
        for branch in writer:
            why = _avro(reader, branch, path, rn, wn)
            if why is not None:
                return why
        return None
    if rk == "union":
        if any(_avro(branch, writer, path, rn, wn) is None for branch in reader):
            return None
        return f"{_where(path)} is {wk} in the writer's schema, no branch of the reader's " \
               f"union reads it"
    if wk in _PRIMITIVES or rk in _PRIMITIVES:
        if rk in _PROMOTIONS.get(wk, {wk}):
            return None
        return f"{_where(path)} changed type from {wk} to {rk}"
    if rk != wk:
        return f"{_where(path)} changed type from {wk} to {rk}"
    if rk in ("record", "enum", "fixed") and not _same_name(reader, writer):
        return (f"{_where(path)}: the {rk} {_short_name(writer['name'])!r} was renamed to "
                f"{_short_name(reader['name'])!r} without an alias (add \"aliases\": "
                f"[{_short_name(writer['name'])!r}] to the reader's {rk})")
    if rk == "record":
        # only the reader's aliases match a writer's field: a writer's own aliases name
        # nothing the reader can ask for (the specification's "Schema Resolution")
        written = {f["name"]: f for f in writer.get("fields", [])}
        for field in reader.get("fields", []):
            sub = f"{path}.{field['name']}" if path else field["name"]
            source = written.get(field["name"]) or next(
                (written[a] for a in field.get("aliases", []) if a in written), None)
            if source is None:
                if "default" not in field:
                    return (f"field {sub!r} is not in the writer's schema and has no default "
                            "in the reader's")
                continue
            why = _avro(field["type"], source["type"], sub, rn, wn)
            if why is not None:
                return why
        return None
    if rk == "enum":
        missing = [s for s in writer.get("symbols", []) if s not in reader.get("symbols", [])]
        if missing and "default" not in reader:
            return f"{_where(path)}: enum symbol(s) {missing} are missing from the reader's"
        return None
    if rk == "fixed":
        if reader.get("size") != writer.get("size"):
            return f"{_where(path)}: fixed size changed from {writer.get('size')} to " \
                   f"{reader.get('size')}"
        return None
    if rk == "array":
        return _avro(reader["items"], writer["items"], f"{path}[]", rn, wn)
    if rk == "map":
        return _avro(reader["values"], writer["values"], f"{path}{{}}", rn, wn)
    return None


def _short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _same_name(reader: dict[str, Any], writer: dict[str, Any]) -> bool:
    """Named types match by unqualified name, or by one of the *reader's* aliases."""
    wanted = _short_name(writer["name"])
    return wanted in {_short_name(n) for n in [reader["name"], *reader.get("aliases", [])]}


# -- JSON Schema -----------------------------------------------------------------------------

def _json(reader: Any, writer: Any, path: str) -> str | None:
    if not isinstance(reader, dict) or not isinstance(writer, dict):
        return None
    rt, wt = reader.get("type"), writer.get("type")
    if rt is not None and wt is not None and _types(rt) != _types(wt) and not (
            _types(wt) <= _types(rt) or (_types(wt) == {"integer"} and "number" in _types(rt))):
        return f"{_where(path)} changed type from {wt} to {rt}"
    required = set(reader.get("required", [])) - set(writer.get("required", []))
    if required:
        name = sorted(required)[0]
        sub = f"{path}.{name}" if path else name
        return (f"field {sub!r} is required by the reader's schema but not by the writer's "
                "(old documents may lack it)")
    r_props, w_props = reader.get("properties", {}), writer.get("properties", {})
    if reader.get("additionalProperties") is False:
        extra = sorted(set(w_props) - set(r_props))
        if extra:
            sub = f"{path}.{extra[0]}" if path else extra[0]
            return f"field {sub!r} is written but the reader's schema forbids it " \
                   "(additionalProperties: false)"
    for name in sorted(set(r_props) & set(w_props)):
        why = _json(r_props[name], w_props[name], f"{path}.{name}" if path else name)
        if why is not None:
            return why
    return None


def _types(t: Any) -> set[str]:
    return set(t) if isinstance(t, list) else {t}
