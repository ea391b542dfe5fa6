"""Sending and receiving multipart messages on the hot path, without pyzmq's per-call sugar.

pyzmq's send_multipart builds an enum flag per frame (SNDMORE | ...), and its
getsockopt (RCVMORE, EVENTS) builds an enum per call; either costs more than
the send or receive itself for small frames. These helpers call the backend
directly with plain integer flags, read "more" from each Frame, and learn that
nothing is waiting from one zmq.Again per burst.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import zmq
from zmq.backend import Socket as _BackendSocket

_send = _BackendSocket.send
_recv = _BackendSocket.recv
SNDMORE = int(zmq.SNDMORE)
DONTWAIT = int(zmq.DONTWAIT)
COPY_THRESHOLD = 64 * 1024  # pyzmq's guidance: below this, copying is cheaper than tracking


def recv_parts(socket: zmq.Socket) -> list[zmq.Frame] | None:
    """All frames of the next message as zero-copy Frames, or None when none is waiting."""
    try:
        frame = _recv(socket, DONTWAIT, copy=False)
    except zmq.Again:
        return None
    parts = [frame]
    while frame.more:
        frame = _recv(socket, 0, copy=False)
        parts.append(frame)
    return parts


class Routed(NamedTuple):
    """A message received on a ROUTER: routing envelope, body, and its first frame (whose
    zmq.SRCFD names the connection it came on)."""

    envelope: list[bytes]
    body: list[memoryview]
    first: zmq.Frame


def recv_routed(socket: zmq.Socket) -> Routed | None:
    """The next message on a ROUTER: its routing envelope and its body; None when none is waiting.

    The envelope is the peer identity (as bytes: it is hashed and sent back), plus the
    empty delimiter a REQ peer adds. The body frames are zero-copy buffers.
    """
    try:
        identity = _recv(socket, DONTWAIT)
    except zmq.Again:
        return None
    envelope = [identity]
    first = frame = _recv(socket, 0, copy=False)  # a ROUTER puts the identity before at least one frame
    if frame.more and not len(frame):
        envelope.append(b"")
        first = frame = _recv(socket, 0, copy=False)
    body = [frame.buffer]
    while frame.more:
        frame = _recv(socket, 0, copy=False)
        body.append(frame.buffer)
    return Routed(envelope, body, first)


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


def bind_error(exc: zmq.ZMQError) -> str:
    """Why a bind failed, in the system's words ("Address already in use"), without pyzmq's address suffix."""
    return zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
