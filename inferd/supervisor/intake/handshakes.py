"""The ZAP handler (ZeroMQ's authentication protocol, RFC 27), in the supervisor's loop: a connection to a
client-facing socket, and any CURVE connection (the control socket's on tcp), finishes its handshake only
once it is answered here.

Two things are decided: whether a CURVE client's key is authorized (CurveServer), and, for the client-facing
sockets (connections.py gives them a ZAP domain), nothing but the order of events. connections.py turns away a
connection past the clients' share of descriptors by closing it, which must come before its client can send
a request (the request's reply would be lost with the connection). Its handshake cannot finish before this
answer, and this answer is given only after every connection report waiting has been read: by then a
connection past the budget has been closed. That order holds because the context has one I/O thread
(parts.py), which reports a connection accepted before it starts the handshake that asks here.

The answers carry no user id: nothing reads ZeroMQ's User-Id of a message (pyzmq's ThreadAuthenticator, which
this replaces, gave the client's key there).
"""

from __future__ import annotations

import zmq

from inferd.ipc.curve import CurveServer
from inferd.supervisor.intake.connections import Connections
from inferd.supervisor.shared.state import StartupError

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends every ZAP request of the context
VERSION = b"1.0"
BURST = 256  # requests answered per readiness


class Handshakes:
    """Answers the ZAP requests of the context's sockets."""

    def __init__(self, context: zmq.Context, curve: CurveServer, connections: Connections) -> None:
        self._context = context
        self._curve = curve
        self._connections = connections
        self.socket: zmq.Socket | None = None

    def start(self) -> None:
        """Bind the handler, before any socket that needs it binds: without one, libzmq lets a NULL
        connection in unasked. StartupError if the authorized keys cannot be read."""
        try:
            self._curve.load_keys()
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read the authorized CURVE keys (server.curve_authorized_keys): {exc}") from None
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)

    def on_readable(self) -> None:
        """Answer the requests waiting (up to a burst), once every connection report waiting has been handled:
        each request was sent after its connection's report, so that report is handled by then. (Should
        handling the reports raise, the requests read go unanswered, and their handshakes time out.)"""
        assert self.socket is not None
        requests = []
        for _ in range(BURST):
            try:
                requests.append(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        self._connections.take_all()
        for frames in requests:
            self.socket.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one request: [routing id, empty, version, request id, status, text, user, metadata]."""
        envelope, request = frames[:2], frames[2:]
        if len(request) < 6 or request[0] != VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [*envelope, VERSION, request_id, b"400", b"not a ZAP 1.0 request", b"", b""]
        request_id, mechanism, credentials = request[1], request[5], request[6:]
        if mechanism == b"CURVE" and (len(credentials) != 1 or not self._curve.authorized(credentials[0])):
            return [*envelope, VERSION, request_id, b"400", b"key not authorized", b"", b""]
        return [*envelope, VERSION, request_id, b"200", b"OK", b"", b""]

    def close(self) -> None:
        """Stop answering."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
