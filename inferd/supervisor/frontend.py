"""The frontend: the ROUTER sockets clients talk to, admission, and every reply.

It decodes and validates each request, puts it in the BatchQueue or answers it
at once (`invalid`, `overloaded`, `unavailable`), and sends every reply. It
never blocks: a reply that cannot be delivered (peer gone, or its high-water
mark reached) is counted and dropped, so one slow client cannot stall the loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import zmq
import zmq.auth

from inferd import protocol
from inferd.config import Config, ModelConfig
from inferd.errors import InvalidRequest
from inferd.ipc.sockets import recv_routed, send_parts, send_parts_tracked
from inferd.protocol import Buffer, ReplyHeader
from inferd.supervisor.batcher import FULL, BatchQueue, QueuedRequest
from inferd.supervisor.stats import Stats

log = logging.getLogger("inferd.frontend")

BURST = 256  # messages read per readiness, so one busy socket cannot starve the others
# A client that stops reading gets this many replies queued, then its replies are
# dropped (and counted): its memory cost to the daemon is bounded.
SEND_HWM = 1000
RECV_HWM = 1000  # and a client that floods gets TCP backpressure, not daemon memory
SIGNATURES_KEPT = 1024  # input signatures remembered as checked, per config


class ReplyTo(NamedTuple):
    """Where a reply goes: the socket the request came on and its routing envelope."""

    socket: zmq.Socket
    envelope: list[bytes]


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def load_curve_secret(path: str) -> bytes:
    """The secret key in a key file written by `inferctl keygen` (zmq.auth's format)."""
    _, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return secret


def check_against_model(header: protocol.RequestHeader, name: str, model: ModelConfig) -> int:
    """Check a request's inputs against what the model takes; return its sample count or raise InvalidRequest."""
    rid = header.id
    if len(header.inputs) != len(model.inputs):
        raise InvalidRequest(f"{name} takes {len(model.inputs)} input(s), the request has {len(header.inputs)}", rid)
    samples = header.inputs[0].shape[0]
    for index, (meta, spec) in enumerate(zip(header.inputs, model.inputs)):
        if meta.dtype != spec.dtype:
            raise InvalidRequest(f"input {index} is {meta.dtype} but {name} takes {spec.dtype}", rid)
        if tuple(meta.shape[1:]) != spec.shape:
            raise InvalidRequest(
                f"input {index} has shape {list(meta.shape)}; {name} takes [N, "
                f"{', '.join(map(str, spec.shape))}] with the batch dim N first",
                rid,
            )
        if meta.shape[0] != samples:
            raise InvalidRequest(f"input {index} has batch dim {meta.shape[0]} but input 0 has {samples}", rid)
    if samples > model.max_batch_size:
        raise InvalidRequest(
            f"the request carries {samples} samples, over max_batch_size {model.max_batch_size} of {name}", rid
        )
    return samples


class Frontend:
    """Client-facing sockets, request admission, and reply delivery."""

    def __init__(self, context: zmq.Context, config: Config, queue: BatchQueue, stats: Stats) -> None:
        self.queue = queue
        self.stats = stats
        self.max_message_bytes = int(config.server.max_message_mb * (1 << 20))
        self.configure(config)
        # Refuse before ZeroMQ buffers absurd frames; between the limit and this
        # ceiling a message is received and answered `invalid` with its size.
        self.hard_limit = 2 * self.max_message_bytes + (1 << 20)
        self.sockets: list[zmq.Socket] = []
        self.live: dict[str, str] = {}
        self.refusal: str | None = "the daemon is starting"
        self.unserved: set[str] = set()  # models no ready worker has loaded yet
        self.undelivered = 0
        self.replies: Counter[str] = Counter()
        self._context = context

    def configure(self, config: Config) -> None:
        """Take a new config: models and their limits, the default deadline."""
        self.config = config
        self.default_timeout_s = config.queue.default_timeout_ms / 1000
        # (model, inputs) -> samples, for signatures that passed check_against_model: clients
        # send the same few again and again, and the check is pure Python.
        self._checked: dict[tuple[str, tuple[protocol.TensorMeta, ...]], int] = {}

    def bind(self) -> None:
        """Bind a ROUTER on every `server.listen` endpoint; tcp ones with CURVE when it is configured."""
        server = self.config.server
        secret = load_curve_secret(server.curve_secret_key) if server.curve_secret_key else None
        for endpoint in server.listen:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.setsockopt(zmq.SNDHWM, SEND_HWM)
            socket.setsockopt(zmq.RCVHWM, RECV_HWM)
            socket.setsockopt(zmq.MAXMSGSIZE, self.hard_limit)
            socket.linger = 0
            tcp = endpoint.startswith("tcp://")
            if tcp and secret is not None:
                socket.curve_secretkey = secret
                socket.curve_server = True
            socket.bind(endpoint)
            self.sockets.append(socket)
            if tcp and secret is None and not _loopback(endpoint):
                log.warning("%s is reachable from the network without authentication; "
                            "set server.curve_secret_key and server.curve_authorized_keys", endpoint)
            log.info("listening on %s%s", endpoint, " (CURVE)" if tcp and secret is not None else "")

    def close(self, linger_ms: int = 0) -> None:
        """Close every client socket, letting queued replies leave for at most `linger_ms`."""
        for socket in self.sockets:
            socket.close(linger=linger_ms)
        self.sockets = []

    def on_readable(self, socket: zmq.Socket) -> None:
        """Read what is waiting on `socket` (up to a burst) and admit or answer each request."""
        for _ in range(BURST):
            message = recv_routed(socket)
            if message is None:
                return
            self.submit(ReplyTo(socket, message[0]), message[1])

    def submit(self, reply_to: ReplyTo, body: Sequence[Buffer]) -> None:
        """Admit one request body, or answer it at once; every body gets exactly one reply."""
        now = time.monotonic()
        name = None
        try:
            request = protocol.decode_request(body, self.max_message_bytes)
            header = request.header
            model = self.config.models.get(header.model)
            if model is None:
                raise InvalidRequest(
                    f"unknown model {header.model!r}; this daemon serves {', '.join(sorted(self.config.models))}",
                    header.id,
                )
            name = header.model
            live = self.live.get(name, "")
            if header.version is not None and header.version != live:
                raise InvalidRequest(
                    f"version {header.version!r} of {name} is not live; the live version is {live!r}", header.id)
            signature = (name, header.inputs)
            samples = self._checked.get(signature)
            if samples is None:
                samples = check_against_model(header, name, model)
                if len(self._checked) >= SIGNATURES_KEPT:
                    self._checked.clear()
                self._checked[signature] = samples
        except InvalidRequest as exc:
            log.debug("request %s invalid: %s", exc.request_id, exc.message)
            self.send_error(reply_to, exc.request_id, protocol.INVALID, exc.message, name)
            return
        if self.refusal is not None or header.model in self.unserved:
            refusal = self.refusal or f"no worker has {header.model} {self.live.get(header.model)} loaded yet"
            self.send_error(reply_to, header.id, protocol.UNAVAILABLE, refusal, header.model)
            return
        timeout = header.timeout_ms / 1000 if header.timeout_ms is not None else self.default_timeout_s
        client = (id(reply_to.socket), reply_to.envelope[0])
        queued = QueuedRequest(header, request.buffers, reply_to, client, samples, now, now + timeout)
        refused = self.queue.put(queued)
        if refused is not None:
            reason = (
                f"the queue is full ({self.queue.max_size} requests); retry later" if refused == FULL else
                f"this connection already has {self.queue.max_per_client} requests waiting "
                "(queue.max_per_client); retry later"
            )
            self.send_error(reply_to, header.id, protocol.OVERLOADED, reason, header.model)
            return
        self.stats.queue_depth(now, header.model, self.live[header.model], self.queue.depth(header.model))

    def reply_ok(self, replies: Sequence[tuple[QueuedRequest, ReplyHeader, Sequence[Buffer]]],
                 by_reference: bool) -> list[zmq.MessageTracker]:
        """Send the `ok` replies of a batch: each request its header and outputs; `by_reference`:
        large outputs without a copy (see send_parts_tracked). They go out back to back, so
        ZeroMQ's I/O thread, woken by the first, finds the rest waiting and writes them together."""
        messages = [
            (request.reply_to, [*request.reply_to.envelope, protocol.encode_reply(header), *outputs])
            for request, header, outputs in replies
        ]
        self.replies[protocol.OK] += len(messages)
        trackers: list[zmq.MessageTracker] = []
        for reply_to, parts in messages:
            try:
                if by_reference:
                    trackers += send_parts_tracked(reply_to.socket, parts)
                else:
                    send_parts(reply_to.socket, parts)
            except zmq.ZMQError as exc:
                self._undeliverable(exc)
        return trackers

    def reply_error(self, request: QueuedRequest, status: str, error: str) -> None:
        """Answer a queued request with an error status."""
        self.send_error(request.reply_to, request.header.id, status, error, request.header.model)

    def send_error(
        self, reply_to: ReplyTo, request_id: protocol.RequestId | None, status: str, error: str,
        model: str | None = None,
    ) -> None:
        """Send an error reply, and count it against its model when the model is one this daemon serves."""
        if model in self.live:
            self.stats.reply(time.monotonic(), model, self.live[model], status)
        self.replies[status] += 1
        try:
            send_parts(reply_to.socket, [*reply_to.envelope, protocol.error_reply(request_id, status, error, model)])
        except zmq.ZMQError as exc:
            self._undeliverable(exc)

    def _undeliverable(self, exc: zmq.ZMQError) -> None:
        # EHOSTUNREACH: the client left; EAGAIN: it stopped reading. Either way the
        # reply has nowhere to go, and waiting for it would stall everyone else.
        self.undelivered += 1
        log.debug("reply undeliverable (%s)", exc.strerror)
