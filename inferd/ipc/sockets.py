"""Sending and receiving multipart messages on the hot path, without pyzmq's per-call sugar.

pyzmq's send_multipart builds an enum flag per frame (SNDMORE | ...), which
costs more than the send itself for small frames, and a non-blocking recv on
an empty socket raises zmq.Again (an exception per burst). These helpers call
the backend directly with plain integer flags and check readiness first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

_send = _BackendSocket.send
_recv = _BackendSocket.recv
_get = _BackendSocket.get
SNDMORE = int(zmq.SNDMORE)
DONTWAIT = int(zmq.DONTWAIT)
RCVMORE = int(zmq.RCVMORE)
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
COPY_THRESHOLD = 64 * 1024  # pyzmq's guidance: below this, copying is cheaper than tracking


def readable(socket: zmq.Socket) -> bool:
    """True when a message is waiting (so a receive will not block or raise)."""
    return bool(_get(socket, EVENTS) & POLLIN)


def recv_parts(socket: zmq.Socket) -> list[zmq.Frame]:
    """All frames of the next message (call when `readable`), as zero-copy Frames."""
    parts = [_recv(socket, 0, copy=False)]
    while _get(socket, RCVMORE):
        parts.append(_recv(socket, 0, copy=False))
    return parts


def recv_routed(socket: zmq.Socket) -> tuple[list[bytes], list[Any]]:
    """The next message on a ROUTER (call when `readable`): its routing envelope and its body.

    The envelope is the peer identity, plus the empty delimiter a REQ peer adds. The
    envelope and the first body frame (a header: small) are copied into bytes, which
    costs less than a Frame; the frames after it come as zero-copy buffers.
    """
    envelope = [_recv(socket, 0)]
    if not _get(socket, RCVMORE):
        return envelope, []
    first = _recv(socket, 0)
    if not first and _get(socket, RCVMORE):
        envelope.append(first)
        first = _recv(socket, 0)
    body = [first]
    while _get(socket, RCVMORE):
        body.append(_recv(socket, 0, copy=False).buffer)
    return envelope, body


def send_parts(socket: zmq.Socket, parts: Sequence[Any]) -> None:
    """Send one multipart message, copying each frame, without blocking.

    Raises zmq.ZMQError (EAGAIN: the peer's queue is full; EHOSTUNREACH: it is gone).
    """
    last = len(parts) - 1
    for index, part in enumerate(parts):
        _send(socket, part, DONTWAIT | (SNDMORE if index < last else 0))


def send_parts_tracked(socket: zmq.Socket, parts: Sequence[Any]) -> list[zmq.MessageTracker]:
    """Send without copying frames of COPY_THRESHOLD bytes or more; they must not change until every
    returned tracker is done. Small frames are still copied (cheaper than tracking them)."""
    last = len(parts) - 1
    trackers = []
    for index, part in enumerate(parts):
        flags = DONTWAIT | (SNDMORE if index < last else 0)
        if len(part) >= COPY_THRESHOLD:
            trackers.append(_send(socket, part, flags, copy=False, track=True))
        else:
            _send(socket, part, flags)
    return trackers
