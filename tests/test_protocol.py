"""The wire format: round trips, every bad-input case, and random garbage."""

from __future__ import annotations

import ml_dtypes
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd import protocol
from inferd.errors import InvalidRequest

LIMIT = 1 << 20


def test_request_round_trip_keeps_dtype_shape_and_bytes():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.array([[1, 2], [3, 4]], dtype=np.int64)
    frames = protocol.encode_request(5, "m", [a, b], version="v1", timeout_ms=250)
    request = protocol.decode_message([bytes(f) for f in frames], LIMIT)
    assert request.header.id == 5 and request.header.model == "m"
    assert request.header.version == "v1" and request.header.timeout_ms == 250
    assert [m.dtype for m in request.header.inputs] == ["float32", "int64"]
    assert [m.shape for m in request.header.inputs] == [(2, 3, 4), (2, 2)]
    assert bytes(request.buffers[0]) == a.tobytes() and bytes(request.buffers[1]) == b.tobytes()


def test_big_endian_and_strided_arrays_travel_little_endian_and_contiguous():
    a = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]
    frames = protocol.encode_request(1, "m", [a])
    request = protocol.decode_message([bytes(f) for f in frames], LIMIT)
    assert request.header.inputs[0].dtype == "float64"
    decoded = np.frombuffer(request.buffers[0], dtype="<f8").reshape(3, 2)
    np.testing.assert_array_equal(decoded, a)


def test_a_dtype_the_wire_cannot_carry_is_refused_by_the_encoder():
    with pytest.raises(InvalidRequest, match="cannot travel"):
        protocol.encode_request(1, "m", [np.zeros(2, dtype=np.complex64)])


def test_the_refusal_lists_every_known_dtype_bfloat16_among_them():
    with pytest.raises(InvalidRequest) as info:
        protocol.encode_request(1, "m", [np.zeros(2, dtype=ml_dtypes.float8_e4m3fn)])
    assert info.value.message == ("dtype float8_e4m3fn cannot travel; use one of bool, uint8, int8, int16, int32, "
                                  "int64, float16, float32, float64, bfloat16, bytes")


def test_a_bfloat16_array_travels_as_its_raw_two_bytes_a_value_contiguous():
    a = np.array([[1.5, -2.0, 3.0], [0.1, 7.0, -0.0]], dtype=np.float32).astype(ml_dtypes.bfloat16)[:, ::2]
    frames = protocol.encode_request(2, "m", [a])
    request = protocol.decode_message([bytes(f) for f in frames], LIMIT)
    assert request.header.inputs == (protocol.TensorMeta("bfloat16", (2, 2)),)
    assert protocol.DTYPES["bfloat16"].itemsize == 2
    # bfloat16 is the top half of a float32: 1.5 is 0x3fc0, -2.0 is 0xc000, 0.1 rounds to 0x3dcd, -0.0 is 0x8000.
    assert np.frombuffer(request.buffers[0], dtype="<u2").tolist() == [0x3FC0, 0x4040, 0x3DCD, 0x8000]
    ready = np.ascontiguousarray(a)
    assert protocol.wire_array(ready) is ready, "a wire-ready array is not copied"


def test_a_bfloat16_reply_decodes_to_an_ml_dtypes_view_of_its_frame():
    header = protocol.ReplyHeader(id=1, status="ok", outputs=(protocol.TensorMeta("bfloat16", (1, 2)),))
    data = bytearray(np.array([0x3FC0, 0xC000], dtype="<u2").tobytes())
    _, (output,) = protocol.decode_reply([protocol.encode_reply(header), memoryview(data)])
    assert output.dtype == ml_dtypes.bfloat16 and output.astype(np.float32).tolist() == [[1.5, -2.0]]
    data[:2] = np.array([0x4000], dtype="<u2").tobytes()
    assert float(output[0, 0]) == 2.0, "the output should be a view, not a copy"


def test_reply_round_trip_gives_views_of_the_frames():
    header = protocol.ReplyHeader(
        id=3, status="ok", model="m", version="v2",
        outputs=(protocol.TensorMeta("float32", (2, 2)),), timing_us=protocol.Timing(1, 2, 3),
    )
    data = bytearray(np.ones((2, 2), dtype=np.float32).tobytes())
    decoded, outputs = protocol.decode_reply([protocol.encode_reply(header), memoryview(data)])
    assert decoded == header
    np.testing.assert_array_equal(outputs[0], np.ones((2, 2)))
    data[:4] = np.float32(7).tobytes()
    assert outputs[0][0, 0] == 7, "the output should be a view, not a copy"


def test_error_reply_carries_no_outputs():
    header, outputs = protocol.decode_reply([protocol.error_reply(4, "invalid", "bad", "m")])
    assert (header.status, header.error, header.model, outputs) == ("invalid", "bad", "m", [])
    assert b"outputs" not in protocol.error_reply(4, "invalid", "bad")


HEADER = b'{"id": 1, "model": "m", "inputs": [{"dtype": "float32", "shape": [2, 3]}]}'
GOOD = b"\0" * 24


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "the message is empty"),
        ([b"nope", GOOD], "not a JSON object"),
        ([b'"a string"', GOOD], "Expected `object`, got `str`"),
        ([b'{"id": 1, "model": "m"}'], "missing required field `inputs`"),
        ([b'{"id": [1], "model": "m", "inputs": []}'], "at `$.id`"),
        ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "float32", "shape": []}]}', b""], "length >= 1"),
        ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "int4", "shape": [1]}]}', b"\0"], "unknown dtype 'int4'"),
        ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "uint8", "shape": [2, 0]}]}', b""], "at least 1"),
        ([b'{"id": 1, "model": "m", "timeout_ms": -5, "inputs": []}'], "timeout_ms must be positive"),
        ([HEADER], "declares 1 input(s) but 0 buffer(s)"),
        ([HEADER, GOOD, GOOD], "declares 1 input(s) but 2 buffer(s)"),
        ([HEADER, GOOD[:-1]], "is 23 bytes, but float32 [2, 3] needs 24 bytes"),
        ([HEADER, b"\0" * (LIMIT + 1)], "over the limit"),
    ],
)
def test_every_bad_request_is_an_invalid_request_with_a_sentence(body, message):
    with pytest.raises(InvalidRequest) as info:
        protocol.decode_message(body, LIMIT)
    assert message in info.value.message
    assert info.value.status == "invalid"


def test_an_oversized_message_is_refused_before_its_header_is_read():
    body = [b"\xff not even json", b"\0" * (LIMIT + 1)]
    with pytest.raises(InvalidRequest, match="over the limit of 1048576 bytes"):
        protocol.decode_message(body, LIMIT)


def test_the_error_names_the_request_id_where_the_header_gives_one():
    with pytest.raises(InvalidRequest) as info:
        protocol.decode_message([b'{"id": "abc", "model": 3, "inputs": []}'], LIMIT)
    assert info.value.request_id == "abc"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values,
        "model": st.text(max_size=5) | json_values,
        "version": st.none() | st.text(max_size=3),
        "timeout_ms": st.integers(-10, 10**20) | json_values,
        "inputs": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "dtype": st.sampled_from([*protocol.DTYPES, "bad"]) | json_values,
                    "shape": st.lists(st.integers(-3, 2**64), max_size=10) | json_values,
                },
            ),
            max_size=4,
        )
        | json_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(header=headers, buffers=st.lists(st.binary(max_size=64), max_size=5))
def test_random_headers_never_raise_anything_but_invalid_request(header, buffers):
    try:
        request = protocol.decode_message([msgspec.json.encode(header), *buffers], LIMIT)
    except InvalidRequest as exc:
        assert exc.message
        return
    # What gets through is self-consistent: one exact-size buffer per input.
    for meta, buffer in zip(request.header.inputs, request.buffers, strict=True):
        assert len(buffer) == int(np.prod(meta.shape)) * protocol.DTYPES[meta.dtype].itemsize


def nested(depth: int, kind: str) -> bytes:
    """A JSON value nested `depth` deep in arrays or objects: deeper than msgspec recurses, at the top."""
    return b"[" * depth + b"]" * depth if kind == "array" else b'{"a":' * depth + b"1" + b"}" * depth


deep_headers = st.builds(
    lambda key, depth, kind: b'{"id":1,"model":"mlp",' + f'"{key}":'.encode() + nested(depth, kind) + b"}",
    st.sampled_from(["id", "model", "inputs", "version", "timeout_ms", "unknown"]),
    st.integers(2, 300_000), st.sampled_from(["array", "object"]),
) | st.builds(nested, st.integers(1, 300_000), st.sampled_from(["array", "object"]))


@settings(max_examples=100, deadline=None)
@given(header=deep_headers, buffers=st.lists(st.binary(max_size=64), max_size=70))
def test_headers_nested_any_depth_with_any_frame_count_are_invalid_requests(header, buffers):
    with pytest.raises(InvalidRequest):
        protocol.decode_message([header, *buffers], LIMIT)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=200), max_size=6))
def test_random_bytes_never_raise_anything_but_invalid_request(frames):
    try:
        protocol.decode_message(frames, LIMIT)
    except InvalidRequest:
        pass


def test_deeply_nested_json_is_an_invalid_request():
    deep = b'{"id": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": "m", "inputs": []}'
    with pytest.raises(InvalidRequest):
        protocol.decode_message([deep], LIMIT)


def test_an_input_in_a_region_has_no_buffer_and_outputs_may_be_placed():
    a = np.arange(6, dtype=np.float32).reshape(1, 6)
    in_region = protocol.TensorMeta("int64", (1, 2), region="r", offset=64)
    frames = protocol.encode_request(3, "m", [a, in_region], outputs=[None, protocol.OutputPlace("r", 128)])
    assert len(frames) == 2, "the input in the region travels as its place, not as a frame"
    request = protocol.decode_message([bytes(f) for f in frames], LIMIT)
    assert isinstance(request, protocol.Request)
    assert request.header.inputs[1] == in_region and request.buffers[1] is None
    assert bytes(request.buffers[0]) == a.tobytes()
    assert request.header.outputs == (None, protocol.OutputPlace("r", 128))
    plain = protocol.encode_request(4, "m", [a])[0]
    assert b"region" not in bytes(plain) and b"outputs" not in bytes(plain), "a request without regions is as before"


@pytest.mark.parametrize("frames, sentence", [
    ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "int64", "shape": [1, 2], "region": "r"}]}', b"x" * 16],
     "declares 1 input(s) (1 in regions) but 1 buffer(s) follow it"),
    ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "int64", "shape": [1, 2], "region": "r", "offset": -1}]}'],
     "Expected `int` >= 0"),
    ([b'{"id": 1, "model": "m", "inputs": [{"dtype": "int64", "shape": [1, 2], "region": "a/b"}]}'],
     "Expected `str` matching regex"),
    ([b'{"id": 2, "op": "register_region", "name": "r", "key": "k"}'],
     "not a valid region message or cancel: Object missing required field `byte_size`"),
    ([b'{"id": 2, "op": "register_region", "name": "r", "key": "k", "byte_size": 0}'], "Expected `int` >= 1"),
    ([b'{"id": 2, "op": "drop_everything"}'], "not a valid region message"),
    ([b'{"id": 2, "op": "region_status"}', b"x"], "a region_status message has no buffers, but 1 follow it"),
    ([b'{"id": 2, "op": "cancel"}', b"x"], "a cancel message has no buffers, but 1 follow it"),
    ([b'{"op": "cancel"}'], "Object missing required field `id`"),
    ([b'{"id": 1, "model": "m", "priority": -1, "inputs": [{"dtype": "int64", "shape": [1, 2]}]}'],
     "Expected `int` >= 0"),
])
def test_bad_region_references_and_messages_are_invalid_with_a_sentence(frames, sentence):
    with pytest.raises(InvalidRequest, match=sentence.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        protocol.decode_message(frames, LIMIT)


def test_a_region_message_or_cancel_round_trips_by_its_op():
    for op in (protocol.RegisterRegion(id=1, name="r", key="inferd-client-x", byte_size=10, offset=2),
               protocol.UnregisterRegion(id="u"), protocol.RegionStatus(id=3, name="r"), protocol.Cancel(id=9)):
        assert protocol.decode_message([protocol.encode_op(op)], LIMIT) == op


def test_a_request_carries_its_priority_and_leaves_it_out_when_it_names_none():
    x = np.zeros((1, 2), np.float32)
    assert protocol.decode_message(protocol.encode_request(1, "m", [x], priority=0), LIMIT).header.priority == 0
    frames = protocol.encode_request(1, "m", [x])
    assert b"priority" not in bytes(frames[0])
    assert protocol.decode_message(frames, LIMIT).header.priority is None


def test_byte_strings_travel_as_lengths_and_bytes_and_come_back_as_an_object_array():
    values = np.array([[b"a\x00\x00", b""], ["né", b"\xff\xfe"]], dtype=object)  # trailing NULs, empty, UTF-8
    frames = protocol.encode_request(1, "m", [values, np.array(["xy", "z"])])
    request = protocol.decode_message([bytes(f) for f in frames], LIMIT)
    assert [(m.dtype, m.shape) for m in request.header.inputs] == [("bytes", (2, 2)), ("bytes", (2,))]
    assert bytes(request.buffers[0]) == (b"\x03\0\0\0a\0\0" + b"\0\0\0\0" + b"\x03\0\0\0n\xc3\xa9"
                                         + b"\x02\0\0\0\xff\xfe")
    reply = protocol.encode_reply(protocol.ReplyHeader(id=1, status=protocol.OK, outputs=(
        protocol.TensorMeta("bytes", (2, 2)),)))
    _, [back] = protocol.decode_reply([reply, request.buffers[0]])
    assert back.dtype == object and back.shape == (2, 2)
    assert back.tolist() == [[b"a\x00\x00", b""], ["né".encode(), b"\xff\xfe"]]


def test_a_fixed_width_bytes_array_is_refused_having_lost_its_trailing_nuls():
    with pytest.raises(InvalidRequest, match="lost the trailing NUL bytes"):
        protocol.encode_request(1, "m", [np.array([b"a\x00", b"b"])])
    with pytest.raises(InvalidRequest, match="of bytes and str only; it holds a int"):
        protocol.encode_request(1, "m", [np.array([b"a", 3], dtype=object)])


@pytest.mark.parametrize("data, shape, sentence", [
    (b"\x05\0\0\0abc", (1,), "element 0 says it is 5 bytes, but 3 are left"),
    (b"\x01\0\0\0a\x01\0", (2,), "element 1 has no length: the data ends after 1 of 2 elements"),
    (b"\x01\0\0\0a\x01\0\0\0b", (1,), "5 bytes follow its 1 elements"),
    (b"\xff\xff\xff\xff", (1,), "element 0 says it is 4294967295 bytes, but 0 are left"),
])
def test_a_bytes_input_whose_lengths_disagree_with_its_data_is_invalid_naming_the_element(data, shape, sentence):
    header = protocol.encode_header(protocol.RequestHeader(id=3, model="m", inputs=(
        protocol.TensorMeta("bytes", shape),)))
    with pytest.raises(InvalidRequest, match=sentence) as refused:
        protocol.decode_message([header, data], LIMIT)
    assert refused.value.request_id == 3 and "input 0 is bytes" in refused.value.message
