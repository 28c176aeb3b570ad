"""JSON values decoded a column at a time, by Arrow's JSON reader (``valueFormat=auto``).

``json.loads`` per value and an Arrow column from the dicts cost ~5 µs a message; Arrow's
reader parses all values of a batch as one document (``python -m bench schema``: 4.9x). What it
does not take exactly as ``json.loads`` would goes value by value (``codec.decode_batch``), so
the result never depends on the path (``tests/schemas/test_columns.py``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

__all__ = ["json_column"]


def json_column(values: pa.Array, type_: pa.DataType) -> pa.Array | None:
    """JSON objects decoded by Arrow's JSON reader into ``type_`` (a struct); None if any
    is not one object that fits.

    All values go through the reader as one document, each inside a line of its own
    ``{"v": <value>, "i": <row>}``: the row numbers must come back as 0, 1, 2... with
    nothing else beside them, so a value that is not exactly one JSON value (``{} {}``,
    ``{}, "x": 1``, one that spans the next line's) cannot shift rows unnoticed: it fails
    to parse, or leaves a row number out of place. Fields the schema does not declare are
    typed by the reader and dropped; where their types differ between values (``[1, "x"]``)
    the reader fails and the values are decoded one by one."""
    if not pa.types.is_struct(type_) or values.null_count or not len(values):
        return None
    values = values.cast(pa.binary())
    rows = pc.cast(pc.cast(pa.array(np.arange(len(values))), pa.string()), pa.binary())
    lines = pc.binary_join_element_wise(pa.scalar(b'{"v":'), values, pa.scalar(b',"i":'),
                                        rows, pa.scalar(b"}"), pa.scalar(b""))
    offsets = pa.array([0, len(values)], pa.int32())
    text = pc.binary_join(pa.ListArray.from_arrays(offsets, lines), b"\n")[0].as_buffer()
    several = int(np.count_nonzero(np.frombuffer(text, np.uint8) == 10)) != len(values) - 1
    try:
        table = pj.read_json(
            pa.BufferReader(text),
            read_options=pj.ReadOptions(use_threads=False, block_size=text.size + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=pa.schema([("v", type_), ("i", pa.int64())]),
                unexpected_field_behavior="infer", newlines_in_values=several))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    if table.column_names != ["v", "i"] or table.num_rows != len(values) or not np.array_equal(
            table.column("i").to_numpy(), np.arange(len(values))):
        return None
    try:
        column = table.column("v").combine_chunks()
        if column.null_count:
            return None  # a value that is JSON null: not an object, said value by value
        return _declared(column, type_)
    except (pa.ArrowException, KeyError):  # e.g. fields the reader typed oddly ([null])
        return None


def _declared(column: pa.Array, type_: pa.DataType) -> pa.Array:
    """``column`` with only the fields ``type_`` declares (the JSON reader adds fields it
    found beside them)."""
    if pa.types.is_struct(type_):
        children = [_declared(column.field(f.name), f.type) for f in type_]
        return pa.StructArray.from_arrays(children, fields=list(type_),
                                          mask=column.is_null() if column.null_count else None)
    if pa.types.is_list(type_) and column.type != type_:
        return pa.ListArray.from_arrays(column.offsets, _declared(column.values,
                                                                  type_.value_type),
                                        type=type_, mask=column.is_null())
    if column.type != type_:
        raise pa.ArrowTypeError(f"{column.type} is not {type_}")
    return column
