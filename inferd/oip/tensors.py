"""Tensors in the Open Inference Protocol: datatypes, and the JSON and binary forms of their data."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from inferd.errors import InvalidRequest, quoted
from inferd.protocol import BYTES, DTYPES, Buffer, bytes_ends, pack_bytes, tensor_bytes, unpack_bytes

# The protocol's datatype names and inferd's wire dtypes, one to one.
DATATYPES: dict[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "BF16": "bfloat16", "FP32": "float32", "FP64": "float64", "BYTES": BYTES,
}
WIRE_TO_DATATYPE: dict[str, str] = {wire: name for name, wire in DATATYPES.items()}
# Triton's model configuration names each datatype TYPE_<its name in the protocol>, but BYTES, TYPE_STRING.
TRITON_TYPES: dict[str, str] = {wire: f"TYPE_{name}" for name, wire in DATATYPES.items()} | {BYTES: "TYPE_STRING"}
MAX_ELEMENTS = 1 << 31  # no tensor of the protocol may claim more, whatever its bytes say


def wire_dtype(datatype: Any, what: str) -> str:
    """inferd's dtype for a protocol datatype name; InvalidRequest naming `what` for any other."""
    if datatype in DATATYPES:
        return DATATYPES[datatype]
    raise InvalidRequest(f"{what} has datatype {quoted(datatype)}; use one of {', '.join(DATATYPES)}")


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape of positive ints of bounded size, or InvalidRequest naming `what`."""
    if not isinstance(shape, (list, tuple)) or not shape or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidRequest(f"{what} has shape {quoted(shape)}: a list of 1 to 8 integers, batch dim first")
    if any(d < 1 for d in shape):
        raise InvalidRequest(f"{what} has shape {quoted(list(shape))}: every dim must be at least 1")
    if math.prod(shape) > MAX_ELEMENTS:
        raise InvalidRequest(f"{what} has shape {quoted(list(shape))}: more than {MAX_ELEMENTS} elements")
    return tuple(shape)


def check_size(size: int, dtype: str, shape: tuple[int, ...], what: str, field: str = "bytes of data") -> None:
    """InvalidRequest unless a tensor of `dtype` and `shape` is `size` bytes (a BYTES tensor's elements say
    their size: the daemon checks them where they lie)."""
    if dtype == BYTES:
        return
    expected = tensor_bytes(dtype, shape)
    if size != expected:
        raise InvalidRequest(f"{what} has {size} {field}, but {WIRE_TO_DATATYPE[dtype]} {list(shape)} needs {expected}")


def from_bytes(data: Buffer, dtype: str, shape: tuple[int, ...], what: str) -> memoryview:
    """Raw little-endian bytes of a tensor (a BYTES one's elements, each a 4-byte little-endian length and its
    bytes), checked against its dtype and shape (no copy)."""
    view = memoryview(data).cast("B")
    if dtype == BYTES:
        try:
            bytes_ends(view, math.prod(shape))
        except ValueError as exc:
            raise InvalidRequest(f"{what} is BYTES {list(shape)}, and its {exc}") from None
        return view
    check_size(len(data), dtype, shape, what)
    return view


CHUNK = 256 << 10  # bytes of a tensor's JSON text decoded at a time: the only Python objects its parse makes
_OPEN, _CLOSE, _COMMA = b"[],"
_NOT_STRUCTURAL = bytes(byte for byte in range(256) if byte not in b"[],")
_UNBRACKET = bytes.maketrans(b"[]", b"  ")
_LEADING = re.compile(rb"[\[\s]*")
_decode_list = msgspec.json.Decoder(list[Any]).decode

def _give(dtype: str) -> str:
    """What to send a tensor of `dtype` as, in JSON."""
    kind = DTYPES[dtype].kind
    return "give true or false" if kind == "b" else "give whole numbers" if kind in "iu" else "give numbers"


def from_json(data: Any, dtype: str, shape: tuple[int, ...], what: str) -> memoryview:
    """A tensor given as JSON `data`, flat or nested as its shape, as raw little-endian bytes: `data` decoded
    already (a small request's), or its text (a large request's: msgspec.Raw, which msgspec has found to be
    valid JSON).

    Text is decoded a chunk at a time into the tensor: decoded whole, a list of Python numbers takes some 32
    bytes an element, many times the text it came from."""
    if dtype == BYTES:
        return _strings(msgspec.json.decode(data) if isinstance(data, msgspec.Raw) else data, shape, what)
    if not isinstance(data, msgspec.Raw):
        return _from_list(data, dtype, shape, what)
    view = np.frombuffer(data, dtype=np.uint8)
    if not view.size or view[0] != _OPEN:
        raise InvalidRequest(f"{what} has data that is not a list")
    count = math.prod(shape)
    nested = _check_nesting(view, shape, count, dtype, what)
    tensor = np.empty(count, dtype=DTYPES[dtype])
    # Each chunk runs from the list's opening bracket or a comma to a comma or its closing bracket, which
    # become the brackets of a list of its own.
    start, end, filled = 0, view.size - 1, 0
    while start < end:
        stop = end if end - start <= CHUNK else _comma_before(view, start, start + CHUNK, what)
        piece = bytearray(view[start:stop + 1])
        if nested:
            piece = piece.translate(_UNBRACKET)
        piece[0], piece[-1] = _OPEN, _CLOSE
        values = _values(piece, dtype, what, filled)
        tensor[filled:filled + len(values)] = _checked(values, dtype, what, filled)
        filled += len(values)
        start = stop
    return tensor.view(np.uint8).data


def _strings(data: Any, shape: tuple[int, ...], what: str) -> memoryview:
    """A BYTES tensor given as JSON strings (flat or nested as its shape), each encoded UTF-8, in its layout."""
    if not isinstance(data, list):
        raise InvalidRequest(f"{what} has data that is not a list")
    values = data if not any(isinstance(value, list) for value in data) else list(_nested(data, shape, what))
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidRequest(f"{what} has {len(values)} values of data, but shape {list(shape)} holds {count}")
    elements = []
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise InvalidRequest(f"{what} is BYTES, but element {index} of its data is not a string ({quoted(value)}); "
                                 "give strings, or send bytes that are not UTF-8 as binary data")
        try:
            elements.append(value.encode())
        except UnicodeEncodeError:
            raise InvalidRequest(f"{what} has a string at element {index} that is not valid UTF-8 (a lone "
                                 "surrogate); send it as binary data") from None
    return memoryview(pack_bytes(elements))


def _nested(data: list[Any], shape: tuple[int, ...], what: str, depth: int = 0) -> Any:
    """The values of `data`, lists nested as `shape`, in order; InvalidRequest where they are nested otherwise,
    as numbers are (a ragged nesting whose total is right would otherwise be read as some other shape)."""
    inner = depth + 1 < len(shape)
    if len(data) != shape[depth]:
        raise InvalidRequest(_ragged(what, shape))
    for value in data:
        if isinstance(value, list) != inner:
            raise InvalidRequest(_ragged(what, shape) if inner else f"{what} has data nested deeper than its shape")
        if inner:
            yield from _nested(value, shape, what, depth + 1)
        else:
            yield value


def _from_list(data: Any, dtype: str, shape: tuple[int, ...], what: str) -> memoryview:
    """A tensor from its values decoded, as lists flat or nested as its shape."""
    if not isinstance(data, list):
        raise InvalidRequest(f"{what} has data that is not a list")
    depth = 1
    nested = data
    while depth <= len(shape) and nested and isinstance(nested[0], list):
        nested = nested[0]
        depth += 1
    _check_depth(depth, shape, what)
    try:
        values = _exact(np.asarray(data), data, dtype).reshape(-1)
    except ValueError:
        raise InvalidRequest(_ragged(what, shape if depth > 1 else None)) from None
    count = math.prod(shape)
    if values.size != count:
        raise InvalidRequest(f"{what} has {values.size} values of data, but shape {list(shape)} holds {count}")
    return np.ascontiguousarray(_checked(values, dtype, what, 0)).view(np.uint8).data


def _check_depth(depth: int, shape: tuple[int, ...], what: str) -> None:
    """InvalidRequest unless data nested `depth` lists deep is flat or nested as `shape`."""
    if depth not in (1, len(shape)):
        depth = min(depth, len(shape) + 1)
        raise InvalidRequest(f"{what} has data nested {'over ' if depth > len(shape) else ''}{depth} lists deep, "
                             f"but its shape {list(shape)} has {len(shape)} dims: give it flat, or nested as its shape")


def _exact(values: np.ndarray, data: Any, dtype: str) -> np.ndarray:
    """`values`, as numpy made them of JSON's numbers `data`, unless that lost what they were: integers beyond
    int64 among others become floats (or objects), which for an integer datatype are kept exact, as objects."""
    if DTYPES[dtype].kind in "iu" and values.dtype.kind in "fO":
        return np.array(data, dtype=object)
    return values


def _comma_before(view: np.ndarray, start: int, stop: int, what: str) -> int:
    """Where the last comma between `start` (one) and `stop` is."""
    for back in (4096, CHUNK):
        found = bytes(view[max(start + 1, stop - back):stop]).rfind(b",")
        if found >= 0:
            return max(start + 1, stop - back) + found
    raise InvalidRequest(f"{what} has a value (or a space) of over {CHUNK} characters in its data")


def _values(text: bytearray, dtype: str, what: str, offset: int) -> np.ndarray:
    """The values of a JSON list of numbers, as an array."""
    try:
        items = _decode_list(text)
    except msgspec.ValidationError as exc:  # a number beyond float64 (msgspec says where)
        index = re.search(r"\$\[(\d+)\]", str(exc))
        at = f" (element {offset + int(index[1])})" if index else ""
        raise InvalidRequest(f"{what} has a number out of range{at}") from None
    return _exact(np.asarray(items), items, dtype)


def _check_nesting(view: np.ndarray, shape: tuple[int, ...], count: int, dtype: str, what: str) -> bool:
    """Check that JSON data (`view`, a list) is flat or nested as `shape`, and holds `count` values of numbers
    (or booleans); whether it is nested."""
    opens = commas = 0
    for start in range(0, view.size, CHUNK):
        piece = view[start:start + CHUNK].tobytes()
        if b'"' in piece or b"{" in piece:
            raise InvalidRequest(f"{what} is {WIRE_TO_DATATYPE[dtype]}, but its data holds strings or objects; "
                                 f"{_give(dtype)}")
        opens += piece.count(b"[")
        commas += piece.count(b",")
    leading = _LEADING.match(view[:4096].tobytes())
    depth = leading[0].count(b"[") if leading else 1
    _check_depth(depth, shape, what)
    if depth == 1:
        if opens > 1:
            raise InvalidRequest(_ragged(what, None))
        given = commas + 1 if commas or view[1:-1].tobytes().strip() else 0
        if given != count:
            raise InvalidRequest(f"{what} has {given} values of data, but shape {list(shape)} holds {count}")
        return False
    lists, separators = _structure(shape)
    if (opens, commas) != (lists, separators) or not _nested_as(_brackets_and_commas(view), shape):
        raise InvalidRequest(_ragged(what, shape))
    return True


def _ragged(what: str, shape: tuple[int, ...] | None) -> str:
    """The sentence for nested data that is not a regular array (of `shape`, where it is nested as deep)."""
    return f"{what} has nested data whose lists differ in length" + (
        f", or do not make shape {list(shape)}" if shape is not None else "")


def _structure(shape: tuple[int, ...]) -> tuple[int, int]:
    """The lists and the commas of JSON data nested as `shape`."""
    if len(shape) == 1:
        return 1, shape[0] - 1
    lists, commas = _structure(shape[1:])
    return 1 + shape[0] * lists, shape[0] * commas + shape[0] - 1


def _brackets_and_commas(view: np.ndarray) -> np.ndarray:
    """The brackets and commas of JSON text, in order."""
    return np.frombuffer(b"".join(view[start:start + CHUNK].tobytes().translate(None, _NOT_STRUCTURAL)
                                  for start in range(0, view.size, CHUNK)), dtype=np.uint8)


def _nested_as(structure: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether the brackets and commas of JSON data are those of lists nested as `shape`."""
    lists, commas = _structure(shape)
    if structure.size != 2 * lists + commas or structure[0] != _OPEN or structure[-1] != _CLOSE:
        return False
    if len(shape) == 1:
        return bool((structure[1:-1] == _COMMA).all())
    # Each element is the same nested list (checked once, as the first), and all but the last a comma after it.
    inner_lists, inner_commas = _structure(shape[1:])
    element = 2 * inner_lists + inner_commas
    first = structure[1:1 + element]
    rows = structure[1:-1 - element].reshape(shape[0] - 1, element + 1)
    return (_nested_as(first, shape[1:]) and bool((rows[:, :-1] == first).all())
            and bool((rows[:, -1] == _COMMA).all()) and bool((structure[-1 - element:-1] == first).all()))


def from_values(data: Any, dtype: str, shape: tuple[int, ...], what: str) -> memoryview:
    """A tensor given as a flat sequence of values (gRPC's typed `contents`), as raw little-endian bytes (of
    BYTES, its byte strings in their layout)."""
    count = math.prod(shape)
    if len(data) != count:
        raise InvalidRequest(f"{what} has {len(data)} values of data, but shape {list(shape)} holds {count}")
    if dtype == BYTES:
        return memoryview(pack_bytes(data))
    values = np.fromiter(data, dtype=_CONTENTS_DTYPES.get(dtype, DTYPES[dtype]), count=count)
    return np.ascontiguousarray(_checked(values, dtype, what, 0)).view(np.uint8).data


# What gRPC's typed contents hold for each dtype that has none of its own width (int_contents are int32).
_CONTENTS_DTYPES = {"int8": np.int32, "int16": np.int32, "uint8": np.uint32}


def _checked(values: np.ndarray, dtype: str, what: str, offset: int) -> np.ndarray:
    """`values` (elements `offset` on of a tensor) as `dtype`, if each one fits it; InvalidRequest naming the
    first that does not."""
    target = DTYPES[dtype]
    # JSON numbers come as bool, int or float: only those the datatype holds exactly are taken.
    # (ml_dtypes' bfloat16 is numpy kind "V": a float all the same.)
    accepted = {"b": "b", "i": "biu", "u": "biu", "f": "biuf", "V": "biuf"}[target.kind]
    kind = _kind(values)
    if values.size and kind not in accepted:
        held = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction"}.get(
            kind, "strings or objects")
        raise InvalidRequest(f"{what} is {WIRE_TO_DATATYPE[dtype]}, but its data holds {held}; {_give(dtype)}")
    if target.kind in "iu" and kind != "b":
        limits = np.iinfo(target)
        bad = np.flatnonzero((values < limits.min) | (values > limits.max))
        if bad.size:
            raise InvalidRequest(f"{what} has values outside the range of {WIRE_TO_DATATYPE[dtype]}, the first "
                                 f"at element {offset + int(bad[0])} ({values[bad[0]]})")
        return values.astype(target, copy=False)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            converted = values.astype(target, copy=False)
    except OverflowError:  # an integer beyond any float
        raise InvalidRequest(f"{what} has values that {WIRE_TO_DATATYPE[dtype]} cannot hold; send finite numbers "
                             "within its range") from None
    if target.kind != "b":
        # A number too large for the datatype would be infinity: refused. (JSON has no NaN or Infinity, and
        # msgspec refuses them; gRPC's typed floats may carry them, as raw bytes may.)
        bad = np.flatnonzero(~np.isfinite(converted) & (True if kind == "i" else np.isfinite(values)))
        if bad.size:
            raise InvalidRequest(f"{what} has values that {WIRE_TO_DATATYPE[dtype]} cannot hold, the first at "
                                 f"element {offset + int(bad[0])} ({values[bad[0]]}); send finite numbers "
                                 "within its range")
    return converted


def _kind(values: np.ndarray) -> str:
    """What `values` hold, as numpy's kind: of Python objects (_exact), "i" where all are integers, "f" where
    some have a fraction, else "O"."""
    if values.dtype.kind != "O":
        return values.dtype.kind
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        return "O"
    return "f" if any(isinstance(value, float) for value in values) else "i"


def to_json(buffer: memoryview | bytes, dtype: str, count: int) -> list[Any] | None:
    """An output's `count` values as the protocol's flat JSON list; None for one that JSON cannot carry (it goes
    as binary data): BYTES with an element that is not UTF-8, or floats with a NaN or an infinity, which JSON has
    no number for (an encoder would write null, and a client would read +inf as NaN)."""
    if dtype != BYTES:
        array = np.frombuffer(buffer, dtype=DTYPES[dtype])
        if array.dtype.kind not in "biu" and not np.isfinite(array).all():  # bfloat16's too, without a copy
            return None
        return array.tolist()
    try:
        return [element.decode() for element in unpack_bytes(buffer, count)]
    except UnicodeDecodeError:
        return None


def metadata(name: str, dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    """A tensor's metadata entry: name, datatype, shape with -1 for the batch dim."""
    return {"name": name, "datatype": WIRE_TO_DATATYPE[dtype], "shape": [-1, *shape]}
