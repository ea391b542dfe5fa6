"""The wire format of inferd's data endpoints, and nothing else.

A request is one ZeroMQ multipart message ``[header, buffer_0, ..., buffer_n-1]``;
a REQ client's empty delimiter frame before the header is accepted and echoed
(ZeroMQ routing, which `ipc.sockets.recv_routed` reads off with the identity).
The header is UTF-8 JSON; buffer i holds input i, C-contiguous, little-endian,
exactly ``prod(shape) * itemsize`` bytes. A reply is ``[header, output_0, ...]``.

Decoding never allocates by a header field: every declared size is checked
against the frames that actually arrived before anything else looks at them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Annotated, NamedTuple

import ml_dtypes
import msgspec
import numpy as np

from inferd.errors import InvalidRequest

Buffer = bytes | bytearray | memoryview

OK = "ok"
INVALID = "invalid"
OVERLOADED = "overloaded"
TIMEOUT = "timeout"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"

# Every dtype travels little-endian; the name is what the header carries. numpy has no
# bfloat16: the wire's is ml_dtypes' (JAX's, the one numpy users share), native-endian,
# so little-endian on the hosts inferd runs on.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in (
        ("bool", "|b1"),
        ("uint8", "|u1"),
        ("int8", "|i1"),
        ("int16", "<i2"),
        ("int32", "<i4"),
        ("int64", "<i8"),
        ("float16", "<f2"),
        ("float32", "<f4"),
        ("float64", "<f8"),
        ("bfloat16", ml_dtypes.bfloat16),
    )
}

MAX_DIMS = 8
MAX_TENSORS = 64

RequestId = int | str


class TensorMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The dtype name and full shape (batch dim first) of one tensor on the wire."""

    dtype: str
    shape: Annotated[tuple[int, ...], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]


class RequestHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The JSON header of a request."""

    id: RequestId
    model: str
    inputs: Annotated[tuple[TensorMeta, ...], msgspec.Meta(max_length=MAX_TENSORS)]
    version: str | None = None
    timeout_ms: int | None = None


class Timing(msgspec.Struct, frozen=True):
    """Microseconds a request spent queued, computing, and in the daemon overall."""

    queue: int
    compute: int
    total: int


class ReplyHeader(msgspec.Struct, frozen=True, omit_defaults=True):
    """The JSON header of a reply; `error` is set on every status but `ok`."""

    id: RequestId | None
    status: str
    model: str | None = None
    version: str | None = None
    outputs: tuple[TensorMeta, ...] = ()
    timing_us: Timing | None = None
    error: str | None = None


class Request(NamedTuple):
    """A decoded request: its header, one buffer per input in order, and the bytes of the whole message."""

    header: RequestHeader
    buffers: list[Buffer]
    nbytes: int


class _IdOnly(msgspec.Struct):
    id: RequestId | None = None


_request_decoder = msgspec.json.Decoder(RequestHeader)
_id_decoder = msgspec.json.Decoder(_IdOnly)
_reply_decoder = msgspec.json.Decoder(ReplyHeader)
_encoder = msgspec.json.Encoder()


def request_id_of(header: Buffer) -> RequestId | None:
    """Best-effort id of a header that failed to decode, so its error reply can name it.

    Skipping a value nested deeper than msgspec recurses raises RecursionError: that
    header has no id anyone can read either.
    """
    try:
        return _id_decoder.decode(header).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


@functools.lru_cache(maxsize=1024)
def _input_sizes(inputs: tuple[TensorMeta, ...]) -> tuple[int, ...] | str:
    """The bytes each declared input must have, or the sentence saying why the declaration is invalid.

    Cached: a client sends the same few signatures again and again.
    """
    sizes = []
    for index, meta in enumerate(inputs):
        dtype = DTYPES.get(meta.dtype)
        if dtype is None:
            return f"input {index} has unknown dtype {meta.dtype!r}; known: {', '.join(DTYPES)}"
        if any(dim <= 0 for dim in meta.shape):
            return f"input {index} has shape {list(meta.shape)}: every dim must be at least 1"
        sizes.append(math.prod(meta.shape) * dtype.itemsize)
    return tuple(sizes)


def decode_request(body: Sequence[Buffer], max_message_bytes: int) -> Request:
    """Decode and structurally check a request body (envelope removed).

    Raises `InvalidRequest` with a sentence saying what is wrong. What the model
    accepts (dtype, per-sample shape, batch size) is the frontend's to check.
    """
    if not body:
        raise InvalidRequest("the message is empty: expected a JSON header and one buffer per input")
    size = sum(len(frame) for frame in body)
    if size > max_message_bytes:
        raise InvalidRequest(
            f"the message is {size} bytes, over the limit of {max_message_bytes} bytes "
            "(server.max_message_mb)",
            request_id_of(body[0]),
        )
    try:
        header = _request_decoder.decode(body[0])
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"the header is not a valid request: {exc}", request_id_of(body[0])) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the header is not a JSON object: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the header nests deeper than any request does") from None
    if header.timeout_ms is not None and header.timeout_ms <= 0:
        raise InvalidRequest(f"timeout_ms must be positive, got {header.timeout_ms}", header.id)
    buffers = body[1:]
    if len(buffers) != len(header.inputs):
        raise InvalidRequest(
            f"the header declares {len(header.inputs)} input(s) but {len(buffers)} buffer(s) follow it",
            header.id,
        )
    sizes = _input_sizes(header.inputs)
    if isinstance(sizes, str):
        raise InvalidRequest(sizes, header.id)
    for index, (meta, buffer, expected) in enumerate(zip(header.inputs, buffers, sizes)):
        if len(buffer) != expected:
            raise InvalidRequest(
                f"input {index} is {len(buffer)} bytes, but {meta.dtype} {list(meta.shape)} "
                f"needs {expected} bytes",
                header.id,
            )
    return Request(header, buffers if isinstance(buffers, list) else list(buffers), size)


def encode_header(header: RequestHeader) -> bytes:
    """Encode a request header; each input's bytes follow it as a frame of its own."""
    return _encoder.encode(header)


def encode_reply(header: ReplyHeader) -> bytes:
    """Encode a reply header; the output buffers follow it as frames of their own."""
    return _encoder.encode(header)


def error_reply(
    request_id: RequestId | None, status: str, error: str, model: str | None = None, version: str | None = None,
) -> bytes:
    """Encode the header of a reply that carries no outputs, only an error sentence (and the
    version that handled the request, where one did)."""
    return _encoder.encode(ReplyHeader(id=request_id, status=status, model=model, version=version, error=error))


def wire_array(array: np.ndarray) -> np.ndarray:
    """`array` as the wire wants it: a known dtype, little-endian, C-contiguous."""
    if array.dtype.name not in DTYPES:
        raise InvalidRequest(f"dtype {array.dtype} cannot travel; use one of {', '.join(DTYPES)}")
    return np.ascontiguousarray(array, dtype=DTYPES[array.dtype.name])


def encode_request(
    request_id: RequestId,
    model: str,
    arrays: Sequence[np.ndarray],
    version: str | None = None,
    timeout_ms: int | None = None,
) -> list[Buffer]:
    """Encode a request: its JSON header, then each array's bytes (no copy of wire-ready arrays)."""
    ready = [wire_array(array) for array in arrays]
    header = RequestHeader(
        id=request_id,
        model=model,
        inputs=tuple(TensorMeta(a.dtype.name, tuple(a.shape)) for a in ready),
        version=version,
        timeout_ms=timeout_ms,
    )
    return [_encoder.encode(header), *(_frame(a) for a in ready)]


def _frame(array: np.ndarray) -> Buffer:
    """The bytes of a wire-ready array, not copied. Exported as uint8: no buffer format
    code names ml_dtypes' bfloat16, so `array.data` of one raises."""
    return array.reshape(-1).view(np.uint8).data if array.size else b""


def decode_reply_header(frame: Buffer) -> ReplyHeader:
    """Decode only the header frame of a reply (for callers that do not look at the outputs)."""
    return _reply_decoder.decode(frame)


def decode_reply(body: Sequence[Buffer]) -> tuple[ReplyHeader, list[np.ndarray]]:
    """Decode a reply body (envelope removed) into its header and its output arrays.

    The arrays are views over the received frames, not copies.
    """
    header = decode_reply_header(body[0])
    if header.status != OK:
        return header, []
    if len(body) - 1 != len(header.outputs):
        raise ValueError(f"reply declares {len(header.outputs)} outputs but carries {len(body) - 1}")
    arrays = [
        np.frombuffer(buffer, dtype=DTYPES[meta.dtype]).reshape(meta.shape)
        for meta, buffer in zip(header.outputs, body[1:])
    ]
    return header, arrays
