"""Tensors in the Open Inference Protocol: datatypes, and the JSON and binary forms of their data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd.errors import InvalidRequest
from inferd.protocol import DTYPES, Buffer, tensor_bytes

# The protocol's datatype names and inferd's wire dtypes, one to one.
DATATYPES: dict[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "BF16": "bfloat16", "FP32": "float32", "FP64": "float64",
}
WIRE_TO_DATATYPE: dict[str, str] = {wire: name for name, wire in DATATYPES.items()}
# Triton's model configuration names each datatype TYPE_<its name in the protocol>.
TRITON_TYPES: dict[str, str] = {wire: f"TYPE_{name}" for name, wire in DATATYPES.items()}
MAX_ELEMENTS = 1 << 31  # no tensor of the protocol may claim more, whatever its bytes say


def wire_dtype(datatype: Any, what: str) -> str:
    """inferd's dtype for a protocol datatype name; InvalidRequest naming `what` for any other."""
    if datatype in DATATYPES:
        return DATATYPES[datatype]
    known = ", ".join(DATATYPES)
    if datatype == "BYTES":
        raise InvalidRequest(f"{what} is BYTES, which inferd does not serve; use one of {known}")
    raise InvalidRequest(f"{what} has datatype {datatype!r}; use one of {known}")


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape of positive ints of bounded size, or InvalidRequest naming `what`."""
    if not isinstance(shape, (list, tuple)) or not shape or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidRequest(f"{what} has shape {shape!r}: a list of 1 to 8 integers, batch dim first")
    if any(d < 1 for d in shape):
        raise InvalidRequest(f"{what} has shape {list(shape)}: every dim must be at least 1")
    if math.prod(shape) > MAX_ELEMENTS:
        raise InvalidRequest(f"{what} has shape {list(shape)}: more than {MAX_ELEMENTS} elements")
    return tuple(shape)


def check_size(size: int, dtype: str, shape: tuple[int, ...], what: str, field: str = "bytes of data") -> None:
    """InvalidRequest unless a tensor of `dtype` and `shape` is `size` bytes."""
    expected = tensor_bytes(dtype, shape)
    if size != expected:
        raise InvalidRequest(f"{what} has {size} {field}, but {WIRE_TO_DATATYPE[dtype]} {list(shape)} needs {expected}")


def from_bytes(data: Buffer, dtype: str, shape: tuple[int, ...], what: str) -> memoryview:
    """Raw little-endian bytes of a tensor, checked against its dtype and shape (no copy)."""
    check_size(len(data), dtype, shape, what)
    return memoryview(data).cast("B")


def from_values(data: Any, dtype: str, shape: tuple[int, ...], what: str) -> bytes:
    """A tensor given as a list of values (JSON `data`, flat or nested as its shape, or gRPC `contents`),
    as raw little-endian bytes."""
    count = math.prod(shape)
    if not isinstance(data, list):
        raise InvalidRequest(f"{what} has data that is not a list")
    depth = _depth(data, len(shape) + 1)
    if depth not in (1, len(shape)):
        raise InvalidRequest(f"{what} has data nested {'over ' if depth > len(shape) else ''}{depth} lists deep, "
                             f"but its shape {list(shape)} has {len(shape)} dims: give it flat, or nested as its shape")
    try:
        raw = np.asarray(data)
    except ValueError:
        raise InvalidRequest(f"{what} has nested data whose lists differ in length") from None
    target = DTYPES[dtype]
    # JSON numbers come as bool, int or float: only those the datatype holds exactly are taken.
    # (ml_dtypes' bfloat16 is numpy kind "V": a float all the same.)
    accepted = {"b": "b", "i": "biu", "u": "biu", "f": "biuf", "V": "biuf"}[target.kind]
    if raw.size != count:
        raise InvalidRequest(f"{what} has {raw.size} values of data, but shape {list(shape)} holds {count}")
    if raw.size and raw.dtype.kind not in accepted:
        raise InvalidRequest(f"{what} is {WIRE_TO_DATATYPE[dtype]}, but its data holds {raw.dtype.kind!r} "
                             "values (b: booleans, i: integers, f: numbers with a fraction, U: strings, O: mixed)")
    if target.kind in "iu" and raw.size and (raw.min() < np.iinfo(target).min or raw.max() > np.iinfo(target).max):
        raise InvalidRequest(f"{what} has values outside the range of {WIRE_TO_DATATYPE[dtype]}")
    return np.ascontiguousarray(raw, dtype=target).tobytes()


def _depth(data: list[Any], limit: int) -> int:
    """How deep `data` nests lists, along its first elements, counted up to `limit` at most."""
    depth = 1
    while depth < limit and data and isinstance(data[0], list):
        data = data[0]
        depth += 1
    return depth


def to_json(buffer: memoryview | bytes, dtype: str) -> list[Any]:
    """An output's bytes as the protocol's flat JSON list."""
    return np.frombuffer(buffer, dtype=DTYPES[dtype]).tolist()


def metadata(name: str, dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    """A tensor's metadata entry: name, datatype, shape with -1 for the batch dim."""
    return {"name": name, "datatype": WIRE_TO_DATATYPE[dtype], "shape": [-1, *shape]}
