"""The hot-path socket helpers, against real ZeroMQ sockets."""

from __future__ import annotations

import pytest
import zmq

from inferd.ipc.sockets import recv_parts, recv_routed, send_parts, send_parts_tracked


@pytest.fixture
def router():
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.linger = 0
    endpoint = f"inproc://router-{id(socket)}"
    socket.bind(endpoint)
    peers = []

    def connect(kind: int) -> zmq.Socket:
        peer = context.socket(kind)
        peer.linger = 0
        peer.connect(endpoint)
        peers.append(peer)
        return peer

    yield socket, connect
    for peer in peers:
        peer.close()
    socket.close()
    context.term()


def _receive(socket: zmq.Socket) -> tuple[list[bytes], list]:
    assert socket.poll(2000)
    message = recv_routed(socket)
    assert message is not None
    return message.envelope, message.body


def test_a_dealer_envelope_is_its_identity_and_the_body_keeps_every_frame(router):
    socket, connect = router
    dealer = connect(zmq.DEALER)
    dealer.send_multipart([b"header", b"x" * 100_000, b""])
    envelope, body = _receive(socket)
    assert len(envelope) == 1 and isinstance(envelope[0], bytes)
    assert body[0] == b"header" and bytes(body[1]) == b"x" * 100_000 and bytes(body[2]) == b""
    send_parts(socket, [*envelope, b"reply"])
    assert dealer.recv_multipart() == [b"reply"]


def test_a_req_delimiter_stays_in_the_envelope_so_the_reply_reaches_the_req(router):
    socket, connect = router
    req = connect(zmq.REQ)
    req.send_multipart([b"header", b"buffer"])
    envelope, body = _receive(socket)
    assert len(envelope) == 2 and envelope[1] == b""
    assert body[0] == b"header" and bytes(body[1]) == b"buffer"
    trackers = send_parts_tracked(socket, [*envelope, b"reply", memoryview(bytearray(200_000))])
    assert req.recv_multipart() == [b"reply", b"\0" * 200_000]
    assert len(trackers) == 1


@pytest.mark.parametrize(("sent", "body"), [([b""], [b""]), ([b"", b""], [b""]), ([b"", b"h"], [b"h"])])
def test_empty_frames_are_not_lost(router, sent, body):
    socket, connect = router
    connect(zmq.DEALER).send_multipart(sent)
    envelope, received = _receive(socket)
    assert [bytes(frame) for frame in received] == body
    assert len(envelope) == (2 if len(sent) == 2 else 1)


def test_nothing_waiting_is_none_not_an_exception(router):
    socket, connect = router
    assert recv_routed(socket) is None and recv_parts(socket) is None
    connect(zmq.DEALER).send_multipart([b"a", b"b"])
    assert socket.poll(2000)
    parts = recv_parts(socket)
    assert [bytes(p) for p in parts[1:]] == [b"a", b"b"] and recv_parts(socket) is None
