"""Avro values decoded a column at a time: every value of a batch walked in step, with numpy.

Decoding value by value (``fastavro.schemaless_reader``, a dict per value, then an Arrow column
from the dicts) costs ~4 µs per value of a 5-field record, most of it Python objects
(``python -m bench schema``). Here all values of a batch are decoded together: a cursor per
value moves through the writer's schema one field at a time, each field a few numpy operations
over every value at once (a varint one byte at a time for the numbers that have one more, a
string a gather of its bytes), and each field's Arrow array is built from the bytes without a
Python object per value. An array or map walks its items in step too: item j of every value
that has one, until none has. The writer's version is then resolved to the reader's (latest)
schema in Arrow: fields matched by name or alias, defaults for missing ones, the promotions
Avro allows.

What this path does not take (unions of several types, recursive types, logical types other
than timestamps and dates, resolutions beyond the above) raises :class:`Unsupported`; a value it
cannot decode raises :class:`Malformed`. Either way the caller decodes the batch value by value
(``codec.decode_batch``), which names the bad value, so the result never depends on the path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["Malformed", "Unsupported", "compile_reader"]

#: days and µs since 1970 of the years 1-9999, as datetime takes them (past them: a bad value)
_MIN_DAY, _MAX_DAY = -719_162, 2_932_896
_MIN_US, _MAX_US = -62_135_596_800_000_000, 253_402_300_799_999_999

_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_PROMOTIONS = {("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"),
               ("long", "double"), ("float", "double"), ("string", "bytes"),
               ("bytes", "string")}


class Unsupported(Exception):
    """The schema has something this path leaves to the value-by-value decoder."""


class Malformed(Exception):
    """Some value does not decode with its writer's schema (or not into the reader's)."""


class _Values:
    """The bytes of a batch's values, with a cursor per value (or per item of a nested
    array): ``pos`` where each one is, ``lim`` where its value ends."""

    def __init__(self, values: pa.Array) -> None:
        if values.null_count:
            raise Malformed("a null value")
        values = values.cast(pa.large_binary()) if pa.types.is_binary(values.type) else values
        offsets = np.frombuffer(values.buffers()[1], dtype=np.int64)[
            values.offset:values.offset + len(values) + 1]
        data = values.buffers()[2]
        raw = np.frombuffer(data, dtype=np.uint8) if data is not None and data.size \
            else np.zeros(0, np.uint8)
        # padded so that a varint read near the end looks at zeros, never past the buffer
        self.buf = np.concatenate([raw[:int(offsets[-1])], np.zeros(16, np.uint8)])
        self.start = offsets[:-1].copy()
        self.end = offsets[1:].copy()

    def varint(self, pos: np.ndarray, lim: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The zigzag varints (Avro int and long) at ``pos``: (values, positions after)."""
        if not len(pos):
            return np.zeros(0, np.int64), pos
        byte = self.buf[pos]
        raw = (byte & 0x7F).astype(np.uint64)
        after = pos + 1
        going = np.flatnonzero(byte & 0x80)  # the numbers that have another byte
        shift = 7
        while len(going):
            if shift > 63:
                raise Malformed("a varint longer than 10 bytes")
            at = after[going]
            byte = self.buf[at]
            raw[going] |= (byte & 0x7F).astype(np.uint64) << np.uint64(shift)
            after[going] = at + 1
            going = going[(byte & 0x80) != 0]
            shift += 7
        if (after > lim).any():
            raise Malformed("a value ends inside a number")
        value = (raw >> np.uint64(1)).astype(np.int64) ^ -(raw & np.uint64(1)).astype(np.int64)
        return value, after

    def fixed(self, pos: np.ndarray, lim: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """``size`` bytes at each of ``pos`` as an (n, size) array."""
        after = pos + size
        if (after > lim).any():
            raise Malformed("a value ends inside a fixed-size field")
        return self.buf[pos[:, None] + np.arange(size)], after

    def blobs(self, pos: np.ndarray, lim: np.ndarray, type_: pa.DataType
              ) -> tuple[pa.Array, np.ndarray]:
        """Length-prefixed bytes at ``pos`` (Avro bytes and string) as an Arrow array."""
        length, pos = self.varint(pos, lim)
        if (length < 0).any() or (pos + length > lim).any():
            raise Malformed("a string or bytes length outside its value")
        return self.gather(pos, length, type_), pos + length

    def gather(self, pos: np.ndarray, length: np.ndarray, type_: pa.DataType) -> pa.Array:
        offsets = np.zeros(len(pos) + 1, np.int64)
        np.cumsum(length, out=offsets[1:])
        total = int(offsets[-1])
        if len(pos) and (pos[1:] == pos[:-1] + length[:-1]).all():
            data = self.buf[pos[0]:pos[0] + total]  # back to back already: one slice
        else:
            index = np.arange(total, dtype=np.int64) + np.repeat(pos - offsets[:-1], length)
            data = self.buf[index]
        large = pa.large_binary() if type_ == pa.binary() else pa.large_string()
        out = pa.Array.from_buffers(large, len(pos),
                                    [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        if large == pa.large_string():
            try:
                out.validate(full=True)  # UTF-8, as a per-value decode would check
            except pa.ArrowInvalid:
                raise Malformed("a string that is not UTF-8") from None
        return out.cast(type_)


Step = Callable[[_Values, np.ndarray, np.ndarray], tuple[pa.Array, np.ndarray]]


class _Compiler:
    """Turns a fastavro-parsed schema into a decoding step and its Arrow type."""

    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named
        self.defining: set[str] = set()

    def step(self, schema: Any) -> tuple[Step, pa.DataType]:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return self.primitive(schema)
            if schema in self.defining:
                raise Unsupported(f"recursive type {schema}")
            if schema not in self.named:
                raise Unsupported(f"unknown type {schema}")
            return self.step(self.named[schema])
        if isinstance(schema, list):
            return self.union(schema)
        kind, logical = schema.get("type"), schema.get("logicalType")
        if logical is not None:
            return self.logical(kind, logical)
        if kind in _PRIMITIVES:
            return self.primitive(kind)
        name = schema.get("name")
        if name is not None:
            self.defining.add(name)
        try:
            if kind == "record":
                return self.record(schema)
            if kind == "enum":
                return self.enum(schema["symbols"])
            if kind == "fixed":
                return self.fixed(int(schema["size"]))
            if kind == "array":
                return self.repeated(schema["items"], None)
            if kind == "map":
                return self.repeated(schema["values"], "string")
            if isinstance(kind, (str, list, dict)):
                return self.step(kind)
        finally:
            self.defining.discard(name)
        raise Unsupported(f"type {kind!r}")

    @staticmethod
    def primitive(kind: str) -> tuple[Step, pa.DataType]:
        if kind == "null":
            return (lambda v, pos, lim: (pa.nulls(len(pos)), pos)), pa.null()
        if kind == "boolean":
            def boolean(v: _Values, pos: np.ndarray, lim: np.ndarray
                        ) -> tuple[pa.Array, np.ndarray]:
                raw, after = v.fixed(pos, lim, 1)
                if (raw > 1).any():
                    raise Malformed("a boolean byte other than 0 or 1")
                return pa.array(raw[:, 0] == 1, pa.bool_()), after
            return boolean, pa.bool_()
        if kind in ("int", "long"):
            type_ = pa.int32() if kind == "int" else pa.int64()

            def integer(v: _Values, pos: np.ndarray, lim: np.ndarray
                        ) -> tuple[pa.Array, np.ndarray]:
                value, after = v.varint(pos, lim)
                if kind == "int" and len(value) and (
                        value.min() < -(2**31) or value.max() >= 2**31):
                    raise Malformed("an int out of range")
                return pa.array(value.astype(type_.to_pandas_dtype()), type_), after
            return integer, type_
        if kind in ("float", "double"):
            size, dtype = (4, "<f4") if kind == "float" else (8, "<f8")
            type_ = pa.float32() if kind == "float" else pa.float64()

            def floating(v: _Values, pos: np.ndarray, lim: np.ndarray
                         ) -> tuple[pa.Array, np.ndarray]:
                raw, after = v.fixed(pos, lim, size)
                return pa.array(np.ascontiguousarray(raw).view(dtype)[:, 0], type_), after
            return floating, type_
        type_ = pa.binary() if kind == "bytes" else pa.string()
        return (lambda v, pos, lim: v.blobs(pos, lim, type_)), type_

    def logical(self, kind: Any, logical: str) -> tuple[Step, pa.DataType]:
        if logical in ("timestamp-millis", "timestamp-micros") and kind == "long":
            scale = 1000 if logical == "timestamp-millis" else 1
            lo, hi, what, type_ = _MIN_US // scale, _MAX_US // scale, "timestamp", \
                pa.timestamp("us", tz="UTC")
        elif logical == "date" and kind == "int":
            scale, lo, hi, what, type_ = 1, _MIN_DAY, _MAX_DAY, "date", pa.date32()
        else:
            raise Unsupported(f"logical type {logical!r}")
        integer, storage = self.primitive(kind)

        def step(v: _Values, pos: np.ndarray, lim: np.ndarray) -> tuple[pa.Array, np.ndarray]:
            raw, after = integer(v, pos, lim)
            n = raw.to_numpy(zero_copy_only=False)
            if len(n) and (n.min() < lo or n.max() > hi):
                raise Malformed(f"a {what} outside the years 1 to 9999")
            return pa.array(n * scale, storage).cast(type_), after
        return step, type_

    def record(self, schema: dict[str, Any]) -> tuple[Step, pa.DataType]:
        fields = [(f["name"], *self.step(f["type"])) for f in schema.get("fields", [])]
        type_ = pa.struct([pa.field(name, t) for name, _, t in fields])

        def record(v: _Values, pos: np.ndarray, lim: np.ndarray
                   ) -> tuple[pa.Array, np.ndarray]:
            children = []
            for _, step, _ in fields:
                child, pos = step(v, pos, lim)
                children.append(child)
            if not children:
                return pa.array([{}] * len(pos), type_), pos
            return pa.StructArray.from_arrays(children, fields=list(type_)), pos
        return record, type_

    @staticmethod
    def enum(symbols: list[str]) -> tuple[Step, pa.DataType]:
        names = pa.array(symbols, pa.string())

        def enum(v: _Values, pos: np.ndarray, lim: np.ndarray) -> tuple[pa.Array, np.ndarray]:
            index, after = v.varint(pos, lim)
            if len(index) and (index.min() < 0 or index.max() >= len(symbols)):
                raise Malformed("an enum index out of range")
            return names.take(pa.array(index)), after
        return enum, pa.string()

    @staticmethod
    def fixed(size: int) -> tuple[Step, pa.DataType]:
        def fixed(v: _Values, pos: np.ndarray, lim: np.ndarray) -> tuple[pa.Array, np.ndarray]:
            if (pos + size > lim).any():
                raise Malformed("a value ends inside a fixed-size field")
            return v.gather(pos, np.full(len(pos), size, np.int64), pa.binary()), pos + size
        return fixed, pa.binary()

    def union(self, branches: list[Any]) -> tuple[Step, pa.DataType]:
        values = [i for i, b in enumerate(branches) if b != "null"]
        if len(values) != 1:
            raise Unsupported("a union of several types")
        which = values[0]
        inner, type_ = self.step(branches[which])

        def union(v: _Values, pos: np.ndarray, lim: np.ndarray) -> tuple[pa.Array, np.ndarray]:
            index, pos = v.varint(pos, lim)
            if len(index) and (index.min() < 0 or index.max() >= len(branches)):
                raise Malformed("a union index out of range")
            present = index == which
            rows = np.flatnonzero(present)
            decoded, after = inner(v, pos[rows], lim[rows])
            pos = pos.copy()
            pos[rows] = after
            if len(rows) == len(index):
                return decoded, pos
            take = np.zeros(len(index), np.int64)
            take[rows] = np.arange(len(rows))
            return decoded.take(pa.array(take, mask=~present)), pos
        return union, type_

    def repeated(self, items: Any, keys: str | None) -> tuple[Step, pa.DataType]:
        """An array (``keys`` None) or a map: blocks of counted items, walked item by item
        across all values that still have one."""
        item, item_type = self.step(items)
        key_step = self.primitive("string")[0] if keys is not None else None
        type_ = pa.list_(item_type) if keys is None else pa.map_(pa.string(), item_type)

        def repeated(v: _Values, pos: np.ndarray, lim: np.ndarray
                     ) -> tuple[pa.Array, np.ndarray]:
            pos = pos.copy()
            counts = np.zeros(len(pos), np.int64)
            owners: list[np.ndarray] = []
            parts: list[pa.Array] = []
            key_parts: list[pa.Array] = []
            active = np.arange(len(pos))
            while len(active):
                count, pos[active] = v.varint(pos[active], lim[active])
                sized = count < 0
                if sized.any():  # a block with its byte size: count is negated
                    rows = active[sized]
                    _, pos[rows] = v.varint(pos[rows], lim[rows])
                    count = np.abs(count)
                for j in range(int(count.max(initial=0))):
                    rows = active[count > j]
                    if key_step is not None:
                        key, pos[rows] = key_step(v, pos[rows], lim[rows])
                        key_parts.append(key)
                    part, pos[rows] = item(v, pos[rows], lim[rows])
                    parts.append(part)
                    owners.append(rows)
                    counts[rows] += 1
                active = active[count != 0]
            offsets = np.zeros(len(pos) + 1, np.int32)
            np.cumsum(counts, out=offsets[1:])
            if parts:
                order = pa.array(np.argsort(np.concatenate(owners), kind="stable"))
                flat = pa.concat_arrays(parts).take(order)
                flat_keys = pa.concat_arrays(key_parts).take(order) if key_parts else None
            else:
                flat = item(v, np.zeros(0, np.int64), np.zeros(0, np.int64))[0]
                flat_keys = pa.array([], pa.string())
            if keys is None:
                return pa.ListArray.from_arrays(pa.array(offsets), flat, type=type_), pos
            return pa.MapArray.from_arrays(pa.array(offsets), flat_keys, flat), pos
        return repeated, type_


def _compile(parsed: Any) -> tuple[Step, pa.DataType]:
    return _Compiler(dict(parsed.get("__named_schemas", {})) if isinstance(parsed, dict)
                     else {}).step(parsed)


def decode_column(values: pa.Array, step: Step) -> pa.Array:
    """Every value of ``values`` (binary) decoded by ``step``; each must end exactly where
    its bytes do."""
    walk = _Values(values)
    out, pos = step(walk, walk.start, walk.end)
    if not np.array_equal(pos, walk.end):
        raise Malformed("bytes left after the record")
    return out


# -- resolution: the writer's version into the reader's --------------------------------------


class _Resolver:
    """Arrow arrays of a writer's schema turned into the reader's, as Avro resolves them."""

    def __init__(self, writer: Any, reader: Any) -> None:
        self.writer_named = dict(writer.get("__named_schemas", {})) \
            if isinstance(writer, dict) else {}
        self.reader_named = dict(reader.get("__named_schemas", {})) \
            if isinstance(reader, dict) else {}

    def _deref(self, schema: Any, named: dict[str, Any]) -> Any:
        if isinstance(schema, str) and schema not in _PRIMITIVES:
            return named[schema]
        if isinstance(schema, dict) and schema.get("type") in _PRIMITIVES \
                and "logicalType" not in schema:
            return schema["type"]
        return schema

    def resolve(self, writer: Any, reader: Any, reader_type: pa.DataType
                ) -> Callable[[pa.Array], pa.Array]:
        w, r = self._deref(writer, self.writer_named), self._deref(reader, self.reader_named)
        if w == r:
            return lambda a: a
        if isinstance(w, list) or isinstance(r, list):
            return self._union(w, r, reader_type)
        if isinstance(w, str) and isinstance(r, str):
            if (w, r) in _PROMOTIONS:
                return lambda a: _cast(a, reader_type)
            raise Unsupported(f"{w} read as {r}")
        if not (isinstance(w, dict) and isinstance(r, dict)) or w.get("type") != r.get("type"):
            raise Unsupported("a type that changed kind")
        kind = r["type"]
        if kind == "record":
            return self._record(w, r, reader_type)
        if kind == "enum":
            return self._enum(w, r)
        if kind in ("array", "map"):
            field = "items" if kind == "array" else "values"
            inner = self.resolve(w[field], r[field], reader_type.value_type if kind == "array"
                                 else reader_type.item_type)
            if kind == "array":
                return lambda a: pa.ListArray.from_arrays(
                    a.offsets, inner(a.values), type=reader_type, mask=a.is_null())
            return lambda a: pa.MapArray.from_arrays(a.offsets, a.keys, inner(a.items))
        raise Unsupported(f"{kind} that changed")

    def _union(self, w: Any, r: Any, reader_type: pa.DataType) -> Callable[[pa.Array], pa.Array]:
        def single(s: Any) -> Any:
            if not isinstance(s, list):
                return s
            values = [b for b in s if b != "null"]
            if len(values) != 1:
                raise Unsupported("a union of several types")
            return values[0]
        nullable_reader = isinstance(r, list) and "null" in r
        inner = self.resolve(single(w), single(r), reader_type)

        def union(a: pa.Array) -> pa.Array:
            if a.null_count and not nullable_reader:
                raise Malformed("a null where the reader's schema takes none")
            return inner(a)
        return union

    def _record(self, w: dict[str, Any], r: dict[str, Any], reader_type: pa.DataType
                ) -> Callable[[pa.Array], pa.Array]:
        # fastavro's matching: each writer field, in order, takes the reader field of its
        # name, else one that names it as an alias
        unmatched = {f["name"]: f for f in r.get("fields", [])}
        aliases = {a: f for f in r.get("fields", []) for a in f.get("aliases", [])}
        source_of: dict[str, dict[str, Any]] = {}
        for wf in w.get("fields", []):
            rf = unmatched.get(wf["name"], aliases.get(wf["name"]))
            if rf is None:
                continue
            if rf["name"] in source_of:
                raise Unsupported(f"two writer fields for {rf['name']!r}")
            source_of[rf["name"]] = wf
            del unmatched[rf["name"]]
        steps: list[Callable[[pa.Array], pa.Array]] = []
        for i, field in enumerate(r.get("fields", [])):
            child_type = reader_type.field(i).type
            source = source_of.get(field["name"])
            if source is None:
                if "default" not in field:
                    raise Unsupported(f"field {field['name']!r} has no writer and no default")
                try:
                    default = pa.array([field["default"]], child_type)
                except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                    raise Unsupported(f"default of {field['name']!r}: {exc}") from None
                steps.append(_constant(default))
                continue
            steps.append(_field(source["name"], self.resolve(source["type"], field["type"],
                                                             child_type)))

        def record(a: pa.Array) -> pa.Array:
            children = [step(a) for step in steps]
            if not children:
                return pa.array([{}] * len(a), reader_type)
            return pa.StructArray.from_arrays(children, fields=list(reader_type),
                                              mask=a.is_null() if a.null_count else None)
        return record

    @staticmethod
    def _enum(w: dict[str, Any], r: dict[str, Any]) -> Callable[[pa.Array], pa.Array]:
        symbols = pa.array(r["symbols"], pa.string())
        default = r.get("default")

        def enum(a: pa.Array) -> pa.Array:
            known = pc.is_in(a, value_set=symbols)
            if pc.all(pc.or_kleene(known, a.is_null())).as_py():
                return a
            if default is None:
                raise Malformed("an enum symbol the reader's schema does not have")
            return pc.if_else(pc.or_kleene(known, a.is_null()), a, pa.scalar(default))
        return enum


def _constant(value: pa.Array) -> Callable[[pa.Array], pa.Array]:
    """A column of ``value`` (one row) as long as the record column it is given."""
    return lambda a: value.take(pa.array(np.zeros(len(a), np.int64)))


def _field(name: str, inner: Callable[[pa.Array], pa.Array]) -> Callable[[pa.Array], pa.Array]:
    """The writer's field ``name`` of a record column, resolved by ``inner``."""
    return lambda a: inner(a.field(name))


def _cast(a: pa.Array, type_: pa.DataType) -> pa.Array:
    try:
        return a.cast(type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise Malformed(f"a value that does not convert to {type_}") from None


def compile_reader(writer: Any, reader: Any, reader_type: pa.DataType
                   ) -> Callable[[pa.Array], pa.Array]:
    """A function from a column of values written with ``writer`` (a fastavro-parsed schema)
    to the column of ``reader_type`` they resolve to in ``reader``. Raises Unsupported now
    for schemas this path leaves to the value-by-value decoder, Malformed when called on a
    value it cannot decode."""
    step, _ = _compile(writer)
    resolve = _Resolver(writer, reader).resolve(writer, reader, reader_type)

    def read(values: pa.Array) -> pa.Array:
        out = resolve(decode_column(values, step))
        if out.type != reader_type:
            out = _cast(out, reader_type)
        return out
    return read
