"""Values through a schema: producers encode and validate them (a bad value is refused before
anything is sent, naming the message and the field); readers decode each message by the
schema version it was written with, resolved to the topic's latest schema.

Encodings: AVRO is Avro binary of the writer's schema (no header: the version travels in the
message property ``tierstream.schema.version``, as Pulsar keeps it in message metadata), JSON
is UTF-8 JSON text, STRING is UTF-8 text, NONE is bytes as given. A message without the
property was written without a schema: version 0, bytes.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from tierstream.errors import ConfigError
from tierstream.schemas.model import MODES, VERSION_PROPERTY, SchemaInfo, SchemaType

__all__ = ["MODES", "Decoder", "Encoder", "arrow_type", "decode_batch", "decode_batches",
           "decoded_schema", "named_versions"]

log = logging.getLogger(__name__)

CORRUPT_COLUMN = "_corrupt_record"


class Encoder:
    """Encodes and checks values for one schema version (producer side)."""

    def __init__(self, info: SchemaInfo) -> None:
        self.info = info
        self._avro: Any = None
        self._json: Any = None
        if info.type is SchemaType.AVRO:
            import fastavro

            self._avro = fastavro.parse_schema(info.parsed)
        elif info.type is SchemaType.JSON:
            import jsonschema

            self._json = jsonschema.validators.validator_for(info.parsed)(info.parsed)

    @property
    def properties(self) -> dict[str, str]:
        return {VERSION_PROPERTY: str(self.info.version)}

    def encode(self, value: Any, index: int = 0) -> bytes:
        """``value`` as the bytes of this schema. AVRO and JSON take a dict (or their
        encoded bytes/text, which are checked); ConfigError names message ``index`` and the
        field otherwise."""
        where = f"message {index} of topic {self.info.topic!r} (schema version " \
                f"{self.info.version}, {self.info.type.value})"
        kind = self.info.type
        if kind is SchemaType.NONE:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ConfigError(f"{where}: expected bytes, got {type(value).__name__}")
            return bytes(value)
        if kind is SchemaType.STRING:
            if isinstance(value, str):
                return value.encode()
            try:
                bytes(value).decode("utf-8")
            except (TypeError, UnicodeDecodeError):
                raise ConfigError(f"{where}: not UTF-8 text") from None
            return bytes(value)
        if kind is SchemaType.JSON:
            doc = value
            if isinstance(value, (bytes, bytearray, str)):
                try:
                    doc = json.loads(value)
                except ValueError as exc:
                    raise ConfigError(f"{where}: not JSON ({exc})") from None
            error = next(iter(self._json.iter_errors(doc)), None)
            if error is not None:
                path = ".".join(str(p) for p in error.absolute_path) or "the value"
                raise ConfigError(f"{where}: field {path!r}: {error.message}")
            return json.dumps(doc, separators=(",", ":")).encode()
        import fastavro
        from fastavro.validation import ValidationError, validate

        if isinstance(value, (bytes, bytearray, memoryview)):
            try:  # already Avro: it must decode with this schema and nothing left over
                buf = io.BytesIO(bytes(value))
                fastavro.schemaless_reader(buf, self._avro, None)
                if buf.read(1):
                    raise ValueError("bytes left after the record")
            except Exception as exc:
                raise ConfigError(
                    f"{where}: the topic has an Avro schema and this value ({len(value)} "
                    f"byte(s)) is not Avro of it ({exc}); give the value as a JSON object "
                    "of the schema's fields, which the schema encodes") from None
            return bytes(value)
        try:
            validate(value, self._avro, raise_errors=True)
        except ValidationError as exc:
            raise ConfigError(f"{where}: {_avro_error(exc, self.info.parsed)}") from None
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self._avro, value)
        return out.getvalue()


    def encode_columns(self, values: pa.Array, properties: pa.Array | None, first: int = 0
                       ) -> tuple[pa.Array, pa.Array]:
        """A batch's ``value`` column encoded (row ``i`` named as message ``first + i``) and
        its ``properties`` (None: none given) with this version recorded in each."""
        encoded = pa.array([self.encode(v, first + i) for i, v in enumerate(values.to_pylist())],
                           pa.binary())
        given = properties.to_pylist() if properties is not None else [None] * len(values)
        version = self.properties
        merged = pa.array([list({**dict(p or []), **version}.items()) for p in given],
                          pa.map_(pa.string(), pa.string()))
        return encoded, merged


def _avro_error(exc: Any, schema: Any) -> str:
    """fastavro's first validation error as ``field 'a.b': 'x' is not int``."""
    errors = getattr(exc, "errors", None) or []
    if errors:
        first = errors[0]
        field = str(getattr(first, "field", None) or "")
        names = [schema.get("name", ""), schema.get("namespace", "")] \
            if isinstance(schema, dict) else []
        for prefix in (f"{names[1]}.{names[0]}." if names and names[1] else "",
                       f"{names[0]}." if names else ""):
            if prefix and field.startswith(prefix):
                field = field[len(prefix):]
                break
        return f"field {field or 'the value'!r}: {first.datum!r} is not {_short(first.schema)}"
    return str(exc)


def _short(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema.get("type"))
    return str(schema)


def arrow_type(info: SchemaInfo) -> pa.DataType:
    """The Arrow type a value of ``info`` decodes to."""
    if info.type is SchemaType.NONE:
        return pa.binary()
    if info.type is SchemaType.STRING:
        return pa.string()
    if info.type is SchemaType.JSON:
        return _json_type(info.parsed)
    return _avro_type(info.parsed, {})


def _avro_type(schema: Any, names: dict[str, pa.DataType]) -> pa.DataType:
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        if len(branches) == 1:
            return _avro_type(branches[0], names)
        return pa.string()  # a union of several types: its JSON text
    if isinstance(schema, str):
        simple = {"null": pa.null(), "boolean": pa.bool_(), "int": pa.int32(),
                  "long": pa.int64(), "float": pa.float32(), "double": pa.float64(),
                  "bytes": pa.binary(), "string": pa.string()}
        if schema in simple:
            return simple[schema]
        return names.get(schema, names.get(schema.rsplit(".", 1)[-1], pa.string()))
    kind, logical = schema.get("type"), schema.get("logicalType")
    if logical in ("timestamp-millis", "timestamp-micros"):
        return pa.timestamp("us", tz="UTC")
    if logical == "date":
        return pa.date32()
    if kind == "record":
        struct = pa.struct([pa.field(f["name"], _avro_type(f["type"], names))
                            for f in schema.get("fields", [])])
        names[schema["name"]] = struct
        return struct
    if kind == "enum":
        return pa.string()
    if kind == "fixed":
        return pa.binary()
    if kind == "array":
        return pa.list_(_avro_type(schema["items"], names))
    if kind == "map":
        return pa.map_(pa.string(), _avro_type(schema["values"], names))
    return _avro_type(kind, names)


def _json_type(schema: Any) -> pa.DataType:
    if not isinstance(schema, dict):
        return pa.string()
    t = schema.get("type")
    types = [x for x in (t if isinstance(t, list) else [t]) if x != "null"]
    t = types[0] if len(types) == 1 else None
    if t == "object" and "properties" in schema:
        return pa.struct([pa.field(k, _json_type(v)) for k, v in schema["properties"].items()])
    if t == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(_json_type(schema["items"]))
    return {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(),
            "boolean": pa.bool_()}.get(str(t), pa.string())  # anything else: its JSON text


class Decoder:
    """Decodes values written with any version of a topic's schema into its latest one."""

    def __init__(self, versions: Iterable[SchemaInfo]) -> None:
        self.versions = {v.version: v for v in versions}
        if not self.versions:
            raise ConfigError("valueFormat=auto needs a topic with a schema")
        self.latest = self.versions[max(self.versions)]
        self.type = arrow_type(self.latest)
        self._parsed: dict[int, Any] = {}
        #: per writer version, a column-at-a-time Avro decoder (None: value by value)
        self._columnar: dict[int, Any] = {}
        #: off: every value through :meth:`decode` (tests compare the two paths)
        self.vectorised = True

    def _avro(self, version: int) -> Any:
        import fastavro

        if version not in self._parsed:
            self._parsed[version] = fastavro.parse_schema(self.versions[version].parsed)
        return self._parsed[version]

    def decode_column(self, values: pa.Array, versions: np.ndarray) -> pa.Array | None:
        """Every value of ``values`` decoded at once into :attr:`type`, or None where this
        leaves them to :meth:`decode` one by one: a value that does not decode, a version
        it does not know, a schema feature the column decoders do not take. The result is
        the same either way (``tests/schemas/test_columns.py`` compares them)."""
        if not self.vectorised or not len(values):
            return None
        kind = self.latest.type
        written = set(np.unique(versions).tolist())
        if any(v != 0 and v not in self.versions for v in written):
            return None  # newer than this read knows: said value by value
        if kind is SchemaType.NONE:
            return values
        if kind is SchemaType.STRING:
            try:
                return values.cast(pa.string())
            except pa.ArrowInvalid:  # not UTF-8: named value by value
                return None
        if 0 in written or any(self.versions[v].type is not kind for v in written):
            return None
        if kind is SchemaType.JSON:
            from tierstream.schemas.json_columns import json_column

            return json_column(values, self.type)
        return self._avro_column(values, versions)

    def _avro_column(self, values: pa.Array, versions: np.ndarray) -> pa.Array | None:
        from tierstream.schemas.avro_columns import Malformed, Unsupported, compile_reader

        distinct = np.unique(versions)
        readers = []
        for version in distinct.tolist():
            if version not in self._columnar:
                try:
                    self._columnar[version] = compile_reader(
                        self._avro(version), self._avro(self.latest.version), self.type)
                except Unsupported as exc:
                    log.debug("schema version %d decodes value by value: %s", version, exc)
                    self._columnar[version] = None
            readers.append(self._columnar[version])
        if any(r is None for r in readers):
            return None
        try:
            if len(distinct) == 1:
                return readers[0](values)
            rows = [np.flatnonzero(versions == v) for v in distinct]
            parts = [read(values.take(pa.array(r))) for read, r in zip(readers, rows,
                                                                       strict=True)]
            order = np.empty(len(values), np.int64)
            order[np.concatenate(rows)] = np.arange(len(values))
            return pa.concat_arrays(parts).take(pa.array(order))
        except Malformed:
            return None

    def decode(self, value: bytes, version: int) -> Any:
        """One value as Python data of the latest schema; raises ValueError if it cannot."""
        latest = self.latest
        writer = self.versions.get(version)
        if version == 0 or writer is None:
            if version != 0:
                raise ValueError(f"schema version {version} is newer than this read knows "
                                 f"(it has 1..{latest.version}; a stream takes the versions "
                                 "that exist when it starts: restart it)")
            if latest.type in (SchemaType.NONE, SchemaType.STRING):
                return value if latest.type is SchemaType.NONE else value.decode()
            raise ValueError("written without a schema (version 0)")
        if latest.type is SchemaType.STRING:
            return value.decode()
        if latest.type is SchemaType.NONE:
            return value
        if latest.type is SchemaType.JSON:
            doc = json.loads(value)
            if pa.types.is_struct(self.type) and not isinstance(doc, dict):
                raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
            return doc  # shaped for the column by decode_batch (only when Arrow cannot)
        import fastavro

        buf = io.BytesIO(value)
        try:
            record = fastavro.schemaless_reader(buf, self._avro(version),
                                                self._avro(latest.version))
        except EOFError as exc:  # fastavro names the buffer object: say what it could not read
            raise ValueError(f"the value ends early ({str(exc).split(' from ')[0]})") from None
        if buf.read(1):
            raise ValueError("bytes left after the record")
        return record


def _fit_json(doc: Any, type_: pa.DataType) -> Any:
    """A JSON document shaped for ``type_`` (unknown shapes kept as JSON text)."""
    if doc is None:
        return None
    if pa.types.is_floating(type_) and isinstance(doc, int) and not isinstance(doc, bool):
        return float(doc)  # a JSON number without a fraction, past int64: still a number
    if pa.types.is_struct(type_):
        if not isinstance(doc, dict):
            raise ValueError(f"expected an object, got {type(doc).__name__}")
        return {f.name: _fit_json(doc.get(f.name), f.type) for f in type_}
    if pa.types.is_list(type_) and isinstance(doc, list):
        return [_fit_json(x, type_.value_type) for x in doc]
    if pa.types.is_string(type_) and not isinstance(doc, str):
        return json.dumps(doc)
    return doc


def decoded_schema(schema: pa.Schema, decoder: Decoder, mode: str) -> pa.Schema:
    """``schema`` (read or output) with ``value`` decoded, and PERMISSIVE's corrupt column."""
    i = schema.get_field_index("value")
    out = schema.set(i, pa.field("value", decoder.type, nullable=True))
    if mode == "PERMISSIVE":
        out = out.append(pa.field(CORRUPT_COLUMN, pa.binary()))
    return out


def decode_batches(batches: Iterable[pa.RecordBatch], decoder: Decoder, mode: str, topic: str
                   ) -> Iterator[pa.RecordBatch]:
    """Each of ``batches`` decoded (:func:`decode_batch`). With DROPMALFORMED, a batch left
    empty is skipped, and how many values were dropped is logged once, at the end."""
    dropped = [0]
    for batch in batches:
        out = decode_batch(batch, decoder, mode, topic, dropped)
        if out.num_rows or mode != "DROPMALFORMED":
            yield out
    if dropped[0]:
        log.warning("dropped %d value(s) of %r that could not be decoded (mode=DROPMALFORMED)",
                    dropped[0], topic)


def decode_batch(batch: pa.RecordBatch, decoder: Decoder, mode: str, topic: str,
                 dropped: list[int] | None = None) -> pa.RecordBatch:
    """``batch`` (the message schema plus ``topic``) with ``value`` decoded into the latest
    schema's type. ``mode``: FAILFAST raises naming topic, partition and position;
    PERMISSIVE leaves null and puts the raw bytes in ``_corrupt_record``; DROPMALFORMED drops
    the message and counts it in ``dropped[0]``."""
    versions = _versions(batch.column("properties"))
    index = batch.schema.get_field_index("value")
    column = decoder.decode_column(batch.column("value"), versions)
    if column is not None:
        out = batch.set_column(index, pa.field("value", decoder.type), column)
        if mode == "PERMISSIVE":
            out = out.append_column(pa.field(CORRUPT_COLUMN, pa.binary()),
                                    pa.nulls(len(column), pa.binary()))
        return out
    return _decode_each(batch, decoder, mode, topic, versions.tolist(), dropped)


def _decode_each(batch: pa.RecordBatch, decoder: Decoder, mode: str, topic: str,
                 versions: list[int], dropped: list[int] | None) -> pa.RecordBatch:
    """:func:`decode_batch` value by value: what names the value that does not decode."""
    values = batch.column("value").to_pylist()
    decoded: list[Any] = [None] * len(values)
    corrupt: list[bytes | None] = [None] * len(values)
    keep = [True] * len(values)

    def failed(i: int, version: int, exc: Exception) -> None:
        if mode == "FAILFAST":
            pos = (batch.column("partition")[i].as_py(), batch.column("segment_id")[i]
                   .as_py(), batch.column("entry_id")[i].as_py(),
                   batch.column("batch_index")[i].as_py())
            raise ConfigError(
                f"cannot decode the value of {topic!r} partition {pos[0]} at position "
                f"{pos[1]}:{pos[2]}:{pos[3]} (schema version {version}): {exc}; "
                "mode=PERMISSIVE keeps it as _corrupt_record, DROPMALFORMED skips it") from None
        decoded[i] = None
        corrupt[i] = values[i]
        keep[i] = mode != "DROPMALFORMED"

    for i, (value, version) in enumerate(zip(values, versions, strict=True)):
        try:
            decoded[i] = decoder.decode(value, version)
        except Exception as exc:
            failed(i, version, exc)
    try:
        column = pa.array(decoded, type=decoder.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a JSON shape Arrow does not take as is
        for i, doc in enumerate(decoded):
            if doc is not None:
                try:
                    decoded[i] = _fit_json(doc, decoder.type)
                    pa.array([decoded[i]], type=decoder.type)  # fits now, or names its value
                except Exception as exc:
                    failed(i, versions[i], exc)
        column = pa.array(decoded, type=decoder.type)
    index = batch.schema.get_field_index("value")
    out = batch.set_column(index, pa.field("value", decoder.type), column)
    if mode == "PERMISSIVE":
        out = out.append_column(pa.field(CORRUPT_COLUMN, pa.binary()),
                                pa.array(corrupt, pa.binary()))
    if mode == "DROPMALFORMED" and not all(keep):
        if dropped is not None:
            dropped[0] += keep.count(False)
        out = out.filter(pa.array(keep))
    return out


def named_versions(batch: pa.RecordBatch) -> set[str]:
    """The distinct values of the version property in ``batch``'s ``properties`` (what the
    broker checks against the topic's versions before storing a batch)."""
    at = batch.schema.get_field_index("properties")  # (a name costs pyarrow an exception)
    if at < 0:
        return set()
    props = batch.column(at)
    if len(props) == 0 or props.null_count == len(props):
        return set()
    import pyarrow.compute as pc  # where it is used: see message_format.key_hashes

    found = pc.map_lookup(props, pa.scalar(VERSION_PROPERTY), "first")
    if found.null_count == len(found):
        return set()
    return {str(v) for v in pc.unique(found.drop_null()).to_pylist()}


def _versions(properties: pa.Array) -> np.ndarray:
    """The schema version of every row, from its properties (0 where none is recorded):
    vectorised over the map's keys, since most rows have a few properties."""
    n = len(properties)
    out = np.zeros(n, dtype=np.int64)
    if n == 0 or properties.null_count == n:
        return out
    offsets = np.asarray(properties.offsets)
    import pyarrow.compute as pc  # where it is used: see message_format.key_hashes

    hits = np.flatnonzero(np.asarray(pc.fill_null(pc.equal(properties.keys, VERSION_PROPERTY),
                                                  False)))
    # a sliced array's keys are its parent's: keep the entries of this slice's rows
    hits = hits[(hits >= offsets[0]) & (hits < offsets[-1])]
    if len(hits):
        rows = np.searchsorted(offsets, hits, side="right") - 1
        out[rows] = np.asarray(properties.items.take(pa.array(hits)).cast(pa.int64()))
    return out
