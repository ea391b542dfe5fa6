"""The wire format of inferd's data endpoints, and nothing else.

A request is one ZeroMQ multipart message ``[header, buffer_0, ..., buffer_n-1]``;
a REQ client's empty delimiter frame before the header is accepted and echoed
(ZeroMQ routing, which `ipc.sockets.recv_routed` reads off with the identity).
The header is UTF-8 JSON; buffer i holds input i, C-contiguous, little-endian,
exactly ``prod(shape) * itemsize`` bytes; a BYTES tensor (dtype ``bytes``) holds its
elements in C order, each a 4-byte little-endian length and then its bytes.
A reply is ``[header, output_0, ...]``.

A local client may instead keep a tensor in a shared-memory region it registered
(`RegisterRegion`): an input that names a `region` has no buffer, and an output
the request places in a region (`OutputPlace`) has no frame in the reply, whose
header says where it was written. Region messages share the data socket with
requests and are told apart by their `op` field, as is a `Cancel`: it names a request of the
same connection, which is then answered `cancelled` (the cancel itself has no reply).

Decoding never allocates by a header field: every declared size is checked
against the frames that actually arrived before anything else looks at them.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Callable, Iterable, Sequence
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
CANCELLED = "cancelled"

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


# A tensor of byte strings (OIP's BYTES): on the wire, in a region and in an arena, its elements in C order, each
# a 4-byte little-endian length and then its bytes, nothing between them. Its size is its elements'.
BYTES = "bytes"
WIRE_DTYPES = (*DTYPES, BYTES)
_LENGTH = struct.Struct("<I")


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of wire dtype `dtype` and shape `shape`, packed (a numeric dtype: a BYTES tensor's size
    is its elements')."""
    return math.prod(shape) * DTYPES[dtype].itemsize


def pack_bytes(elements: Iterable[bytes | str]) -> bytes:
    """Byte strings (a `str` is encoded UTF-8) in the BYTES layout."""
    parts: list[bytes] = []
    for element in elements:
        data = element.encode() if isinstance(element, str) else bytes(element)
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


def bytes_ends(buffer: Buffer, count: int) -> list[int]:
    """Where each of the `count` elements of a BYTES tensor in `buffer` ends; ValueError with what is wrong
    (a length that runs past the buffer, fewer elements, bytes left over) naming the element."""
    ends = []
    position, size = 0, len(buffer)
    for index in range(count):
        if position + 4 > size:
            raise ValueError(f"element {index} has no length: the data ends after {index} of {count} elements")
        length = _LENGTH.unpack_from(buffer, position)[0]
        position += 4 + length
        if position > size:
            raise ValueError(f"element {index} says it is {length} bytes, but {size - position + length} are left")
        ends.append(position)
    if position != size:
        raise ValueError(f"{size - position} bytes follow its {count} elements")
    return ends


def unpack_bytes(buffer: Buffer, count: int) -> list[bytes]:
    """The `count` byte strings of a BYTES tensor in `buffer` (ValueError as bytes_ends says)."""
    view = memoryview(buffer).cast("B")
    start = 0
    elements = []
    for end in bytes_ends(view, count):
        elements.append(bytes(view[start + 4:end]))
        start = end
    return elements


def bytes_array(buffer: Buffer, shape: Sequence[int]) -> np.ndarray:
    """A BYTES tensor of `shape` in `buffer` as a numpy object array of `bytes`."""
    array = np.empty(math.prod(shape), dtype=object)
    array[:] = unpack_bytes(buffer, len(array))
    return array.reshape(shape)

MAX_DIMS = 8
MAX_TENSORS = 64
MAX_GROUP = 256  # the most requests (or replies) one message carries as a group
# The `peer` a gateway names its own region's messages and requests with (oip/hop_region.py): no client's
# connection is named so (shm.peer_name).
GATEWAY_PEER = "(gateway)"
DEFAULT_MAX_MESSAGE_MB = 64  # server.max_message_mb's default, which the Python client assumes unless told

RequestId = int | str


REGION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
RegionName = Annotated[str, msgspec.Meta(pattern=REGION_NAME.pattern)]
Offset = Annotated[int, msgspec.Meta(ge=0)]


class TensorMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The dtype name and full shape (batch dim first) of one tensor on the wire, and the region
    (of the client's connection) and byte offset in it where its bytes lie instead of in a frame (and, for a
    BYTES tensor there, how many bytes it takes)."""

    dtype: str
    shape: Annotated[tuple[int, ...], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]
    region: RegionName | None = None
    offset: Offset = 0
    byte_size: Annotated[int, msgspec.Meta(ge=0)] | None = None  # of a BYTES tensor in a region: its bytes there


class OutputPlace(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where a request asks one of its outputs written: a region of its connection, from `offset` on; with
    `byte_size`, at most that many bytes there, and a larger output comes in the reply's frames instead (without
    it, an output the region cannot hold fails its request)."""

    region: RegionName
    offset: Offset = 0
    byte_size: Annotated[int, msgspec.Meta(ge=0)] | None = None


class RequestHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The JSON header of a request."""

    id: RequestId
    model: str
    inputs: Annotated[tuple[TensorMeta, ...], msgspec.Meta(max_length=MAX_TENSORS)]
    version: str | None = None
    timeout_ms: int | None = None
    priority: Annotated[int, msgspec.Meta(ge=0)] | None = None  # 0 most urgent; None: queue.default_priority
    outputs: Annotated[tuple[OutputPlace | None, ...], msgspec.Meta(max_length=MAX_TENSORS)] = ()
    peer: str | None = None  # from a gateway only: its client's connection, whose regions these are


class RegisterRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op",
                     tag="register_region"):
    """Register `byte_size` bytes from `offset` on of the shared memory `key` (a POSIX name, in
    /dev/shm) as this connection's region `name`."""

    id: RequestId
    name: RegionName
    key: str
    byte_size: Annotated[int, msgspec.Meta(gt=0)]
    offset: Offset = 0
    peer: str | None = None


class UnregisterRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op",
                       tag="unregister_region"):
    """Unregister this connection's region `name`, or (None) every region it has."""

    id: RequestId
    name: RegionName | None = None
    peer: str | None = None


class RegionStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op",
                   tag="region_status"):
    """List this connection's region `name`, or (None) every region it has."""

    id: RequestId
    name: RegionName | None = None
    peer: str | None = None


RegionOp = RegisterRegion | UnregisterRegion | RegionStatus


class Cancel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op", tag="cancel"):
    """Cancel this connection's request `id`: if it still waits it is answered `cancelled` and never
    computed; if its batch runs, its result is dropped and it is answered `cancelled`."""

    id: RequestId


Op = RegionOp | Cancel


class RegionInfo(msgspec.Struct, frozen=True):
    """A registered region, as a region message's reply lists it."""

    name: str
    key: str
    offset: int
    byte_size: int


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
    regions: tuple[RegionInfo, ...] | None = None  # the answer to a region message


class Request(NamedTuple):
    """A decoded request: its header, one entry per input in order (its buffer, or None for an input
    that lies in a region), and the bytes of the whole message."""

    header: RequestHeader
    buffers: list[Buffer | None]
    nbytes: int


class Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The first frame of a message that carries several requests, or several replies: how many frames each
    member takes, its header's included, in the order they follow."""

    group: Annotated[tuple[Annotated[int, msgspec.Meta(ge=1)], ...], msgspec.Meta(min_length=1,
                                                                                   max_length=MAX_GROUP)]


class _GroupOnly(msgspec.Struct, forbid_unknown_fields=True):
    group: object = None


class _IdOnly(msgspec.Struct):
    id: RequestId | None = None


class _OpOnly(msgspec.Struct):
    op: str | None = None


_request_decoder = msgspec.json.Decoder(RequestHeader)
_op_field_decoder = msgspec.json.Decoder(_OpOnly)
_op_decoder = msgspec.json.Decoder(Op)
_id_decoder = msgspec.json.Decoder(_IdOnly)
_group_decoder = msgspec.json.Decoder(Group)
_group_probe = msgspec.json.Decoder(_GroupOnly)
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
def _input_sizes(inputs: tuple[TensorMeta, ...]) -> tuple[int | None, ...] | str:
    """The bytes each declared input must have (None for a BYTES one: its elements say), or the sentence saying
    why the declaration is invalid.

    Cached: a client sends the same few signatures again and again.
    """
    sizes: list[int | None] = []
    for index, meta in enumerate(inputs):
        if meta.dtype not in WIRE_DTYPES:
            return f"input {index} has unknown dtype {meta.dtype!r}; known: {', '.join(WIRE_DTYPES)}"
        if any(dim <= 0 for dim in meta.shape):
            return f"input {index} has shape {list(meta.shape)}: every dim must be at least 1"
        sizes.append(None if meta.dtype == BYTES else tensor_bytes(meta.dtype, meta.shape))
    return tuple(sizes)


def input_sizes(inputs: tuple[TensorMeta, ...], request_id: RequestId | None = None) -> tuple[int | None, ...]:
    """The bytes each declared input has (None: BYTES); InvalidRequest if a dtype or shape cannot be."""
    sizes = _input_sizes(inputs)
    if isinstance(sizes, str):
        raise InvalidRequest(sizes, request_id)
    return sizes


def _decode_header(frame: Buffer) -> RequestHeader | Op:
    try:
        return _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        error = exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the header is not a JSON object: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the header nests deeper than any request does") from None
    # Not a request: a region message or a cancel, or a request with a mistake in it (whose error to report).
    try:
        is_op = _op_field_decoder.decode(frame).op is not None
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        is_op = False
    if not is_op:
        raise InvalidRequest(f"the header is not a valid request: {error}", request_id_of(frame))
    try:
        return _op_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"the header is not a valid region message or cancel: {exc}",
                             request_id_of(frame)) from None


def decode_message(body: Sequence[Buffer], max_message_bytes: int) -> Request | Op:
    """Decode and structurally check a message on a data socket (envelope removed): a request, or a
    region message or cancel (which have no buffers).

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
    header = _decode_header(body[0])
    if not isinstance(header, RequestHeader):
        if len(body) > 1:
            raise InvalidRequest(f"a {header.__struct_config__.tag} message has no buffers, but {len(body) - 1} "
                                 "follow it", header.id)
        return header
    if header.timeout_ms is not None and header.timeout_ms <= 0:
        raise InvalidRequest(f"timeout_ms must be positive, got {header.timeout_ms}", header.id)
    inputs = header.inputs
    inline: Sequence[int] = range(len(inputs))
    if any(meta.region is not None for meta in inputs):
        inline = [index for index, meta in enumerate(inputs) if meta.region is None]
    if len(body) - 1 != len(inline):
        in_regions = f" ({len(inputs) - len(inline)} in regions)" if len(inline) < len(inputs) else ""
        raise InvalidRequest(
            f"the header declares {len(inputs)} input(s){in_regions} but {len(body) - 1} buffer(s) "
            "follow it",
            header.id,
        )
    sizes = input_sizes(inputs, header.id)
    buffers: list[Buffer | None] = [None] * len(inputs)
    for index, buffer in zip(inline, body[1:]):
        meta, expected = inputs[index], sizes[index]
        if expected is None:
            try:
                bytes_ends(buffer, math.prod(meta.shape))
            except ValueError as exc:
                raise InvalidRequest(f"input {index} is bytes {list(meta.shape)}, and its {exc}", header.id) from None
        elif len(buffer) != expected:
            raise InvalidRequest(
                f"input {index} is {len(buffer)} bytes, but {meta.dtype} {list(meta.shape)} "
                f"needs {expected} bytes",
                header.id,
            )
        buffers[index] = buffer
    return Request(header, buffers, size)


def group_of(body: Sequence[Buffer], max_message_bytes: int) -> list[Sequence[Buffer]] | None:
    """The members of a message that carries a group (each member's frames, its header first), or None for a
    message of one request or reply. InvalidRequest, for the whole message, where its first frame is a group's
    but the frames do not follow as it says, or the message is over `max_message_bytes`."""
    first = body[0] if body else b""
    if len(first) > 16 * MAX_GROUP or b'"group"' not in bytes(first[:16]):  # a request's header starts otherwise
        return None
    try:
        _group_probe.decode(first)  # its one key is "group": a group, whose mistakes are said as a group's
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    try:
        sizes = _group_decoder.decode(first).group
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"the group's first frame is not a list of 1 to {MAX_GROUP} frame counts, each at "
                             f"least 1: {exc}") from None
    if sum(sizes) != len(body) - 1:
        raise InvalidRequest(f"the group's first frame counts {sum(sizes)} frames, but {len(body) - 1} follow it")
    size = sum(len(frame) for frame in body)
    if size > max_message_bytes:
        raise InvalidRequest(f"the message is {size} bytes, over the limit of {max_message_bytes} bytes "
                             "(server.max_message_mb), its group's members together")
    members, at = [], 1
    for count in sizes:
        members.append(body[at:at + count])
        at += count
    return members


def encode_group(members: Sequence[Sequence[Buffer]]) -> list[Buffer]:
    """Several requests (or replies), each its frames, as the frames of one message."""
    frames: list[Buffer] = [_encoder.encode(Group(tuple(len(member) for member in members)))]
    for member in members:
        frames += member
    return frames


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
    """`array` as the wire wants it: a known dtype, little-endian, C-contiguous; or an object array of `bytes` and
    `str` (a unicode array becomes one), which travels as BYTES."""
    if array.dtype.kind == "U":
        array = array.astype(object)
    if array.dtype.kind == "O":
        strange = next((value for value in array.flat if not isinstance(value, (bytes, str))), None)
        if strange is not None:
            raise InvalidRequest(f"an object array travels as BYTES, of bytes and str only; it holds a "
                                 f"{type(strange).__name__}")
        return array
    if array.dtype.kind == "S":
        raise InvalidRequest(f"a fixed-width bytes array ({array.dtype}) has lost the trailing NUL bytes of its "
                             "elements already; send an object array of bytes (np.array(values, dtype=object))")
    if array.dtype.name not in DTYPES:
        raise InvalidRequest(f"dtype {array.dtype} cannot travel; use one of {', '.join(WIRE_DTYPES)}")
    return np.ascontiguousarray(array, dtype=DTYPES[array.dtype.name])


def wire_size(array: np.ndarray) -> int:
    """The bytes a wire-ready array takes in a message."""
    if array.dtype.kind != "O":
        return array.nbytes
    return sum(4 + (len(value.encode()) if isinstance(value, str) else len(value)) for value in array.flat)


def wire_dtype(array: np.ndarray) -> str:
    """The wire's name for a wire-ready array's dtype."""
    return BYTES if array.dtype.kind == "O" else array.dtype.name


def encode_request(
    request_id: RequestId,
    model: str,
    inputs: Sequence[np.ndarray | TensorMeta],
    version: str | None = None,
    timeout_ms: int | None = None,
    outputs: Sequence[OutputPlace | None] = (),
    priority: int | None = None,
) -> list[Buffer]:
    """Encode a request: its JSON header, then each array's bytes (no copy of wire-ready arrays).

    An input given as a TensorMeta that names a region lies there and has no buffer; `outputs`
    places outputs in regions (None: in the reply).
    """
    metas = []
    frames: list[Buffer] = []
    for value in inputs:
        if isinstance(value, TensorMeta):
            metas.append(value)
            continue
        ready = wire_array(value)
        metas.append(TensorMeta(wire_dtype(ready), tuple(ready.shape)))
        frames.append(frame_of(ready))
    header = RequestHeader(id=request_id, model=model, inputs=tuple(metas), version=version,
                           timeout_ms=timeout_ms, priority=priority, outputs=tuple(outputs))
    return [_encoder.encode(header), *frames]


def encode_op(op: Op) -> bytes:
    """Encode a region message or a cancel (they have no buffers)."""
    return _encoder.encode(op)


def frame_of(array: np.ndarray) -> Buffer:
    """The bytes of a wire-ready array: a numeric one's not copied (exported as uint8: no buffer format code names
    ml_dtypes' bfloat16, so `array.data` of one raises), an object array's packed as BYTES."""
    if array.dtype.kind == "O":
        return pack_bytes(array.flat)
    return array.reshape(-1).view(np.uint8).data if array.size else b""


def decode_reply_header(frame: Buffer) -> ReplyHeader:
    """Decode only the header frame of a reply (for callers that do not look at the outputs)."""
    return _reply_decoder.decode(frame)


def decode_reply(
    body: Sequence[Buffer], from_region: Callable[[TensorMeta], np.ndarray] | None = None,
) -> tuple[ReplyHeader, list[np.ndarray]]:
    """Decode a reply body (envelope removed) into its header and its output arrays.

    The arrays are views over the received frames, not copies; an output written to a region
    is what `from_region` makes of its description (a ValueError without it).
    """
    header = decode_reply_header(body[0])
    if header.status != OK:
        return header, []
    frames = iter(body[1:])
    arrays = []
    for meta in header.outputs:
        if meta.region is not None:
            if from_region is None:
                raise ValueError(f"reply places an output in region {meta.region!r}, which this caller has not")
            arrays.append(from_region(meta))
            continue
        buffer = next(frames, None)
        if buffer is None:
            raise ValueError(f"reply declares {len(header.outputs)} outputs but carries {len(body) - 1}")
        arrays.append(bytes_array(buffer, meta.shape) if meta.dtype == BYTES
                      else np.frombuffer(buffer, dtype=DTYPES[meta.dtype]).reshape(meta.shape))
    if next(frames, None) is not None:
        raise ValueError(f"reply declares {len(header.outputs)} outputs but carries {len(body) - 1}")
    return header, arrays
