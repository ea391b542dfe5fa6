"""The frontend: the ROUTER sockets clients talk to, admission, and every reply.

It decodes and validates each request, puts it in the BatchQueue or answers it
at once (`invalid`, `overloaded`, `unavailable`), and sends every reply. It
never blocks: a reply that cannot be delivered (peer gone, or its high-water
mark reached) is counted and dropped, so one slow client cannot block the loop.
Admission is decided here: whether the daemon takes requests at all, which
models no worker serves yet, the bounds of the queue (where an urgent request may
displace a less urgent one), and whether a request could still finish before its
deadline. A cancel takes its request out of the queue, or marks it in its batch
(the dispatcher's, through `take_cancels`). Region messages and requests that name
clients' shared-memory regions go to client_regions.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import NamedTuple

import zmq

from inferd import protocol
from inferd.addresses import loopback
from inferd.config import Config, ModelConfig
from inferd.curve import CurveServer
from inferd.errors import InvalidRequest
from inferd.ipc.sockets import recv_routed, send_parts, send_parts_tracked
from inferd.protocol import Buffer, ReplyHeader
from inferd.supervisor.backstop import failure
from inferd.supervisor.batcher import BatchQueue, QueuedRequest, Refusal
from inferd.supervisor.candidates import Candidates
from inferd.supervisor.client_regions import ClientRegions, Places
from inferd.supervisor.forecast import Forecast
from inferd.supervisor.live import LiveVersions
from inferd.supervisor.regions import Regions, RegionSlice
from inferd.supervisor.state import DaemonState
from inferd.supervisor.stats import Stats
from inferd.supervisor.workers import WorkerState, WorkerTable

log = logging.getLogger("inferd.frontend")

BURST = 256  # messages read per readiness, so one busy socket cannot starve the others
# A client that stops reading gets this many replies queued, then its replies are
# dropped (and counted): its memory cost to the daemon is bounded.
SEND_HWM = 1000
MAX_RECV_HWM = 1000  # and a client that floods small requests gets TCP backpressure, not daemon memory
MIN_RECV_HWM = 64
SIGNATURES_KEPT = 1024  # input signatures remembered as checked, per config


class ReplyTo(NamedTuple):
    """Where a reply goes: the socket the request came on and its routing envelope."""

    socket: zmq.Socket
    envelope: list[bytes]


def receive_limits(config: Config) -> tuple[int, int]:
    """(largest message ZeroMQ receives, messages it may hold per connection); so one connection can
    make ZeroMQ hold at most (hwm + 1) x largest bytes (README, "Memory").

    Between server.max_message_mb and `largest` a message is received and answered
    `invalid` with its size; a larger one makes ZeroMQ drop the connection. The number
    of messages held is what the per-connection byte share allows, but at least
    MIN_RECV_HWM, the depth a client pipelines on one connection (the benchmark's load
    generator and inferd's Client keep up to 64 in flight): with fewer, ZeroMQ's I/O
    thread stops and waits for the loop every few small requests (measured: 2 to 5 us
    more supervisor CPU per request at 32 and 16, a quarter of the throughput at 2).
    The operator's bound is server.max_message_mb: the largest request it must take.
    """
    limit = int(config.server.max_message_mb * (1 << 20))
    largest = limit + max(1 << 20, limit // 4)
    hwm = max(MIN_RECV_HWM, min(MAX_RECV_HWM, config.queue.max_bytes_per_client // largest))
    return largest, hwm


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


def _refusal_sentence(refusal: Refusal, queue: BatchQueue) -> str:
    bounds = queue.bounds
    return {
        Refusal.FULL: f"the queue is full ({bounds.max_size} requests); retry later",
        Refusal.BYTES: f"the queue holds {queue.nbytes} bytes of requests and this one would pass queue.max_bytes "
                       f"({bounds.max_bytes}); retry later",
        Refusal.CLIENT_FULL: f"this connection already has {bounds.max_per_client} requests waiting "
                             "(queue.max_per_client); retry later",
        Refusal.CLIENT_BYTES: "this connection's waiting requests would pass queue.max_bytes_per_client "
                              f"({bounds.max_bytes_per_client} bytes); retry later",
    }[refusal]


class Frontend:
    """Client-facing sockets, request admission, and reply delivery."""

    def __init__(self, context: zmq.Context, config: Config, queue: BatchQueue, stats: Stats,
                 live: LiveVersions, candidates: Candidates, curve: CurveServer, regions: Regions,
                 forecast: Forecast) -> None:
        self.queue = queue
        self.forecast = forecast
        self.stats = stats
        self.live = live
        self.candidates = candidates
        self.sockets: list[zmq.Socket] = []
        self.protocols: dict[zmq.Socket, str] = {}  # the gateways' sockets -> the protocol each carries
        self._internal_paths: list[Path] = []  # their ipc socket files, removed at close
        self.refusal: str | None = "the daemon is starting"
        self.unserved: set[str] = set()  # models no ready worker has loaded yet
        self._admitted: set[str] = set()  # models that took requests since note_queue_depths
        self._cancels: list[tuple[Hashable, protocol.RequestId]] = []  # of requests not waiting: maybe running
        self._context = context
        self._curve = curve
        self.configure(config)
        self.client_regions = ClientRegions(regions, config.server)

    def configure(self, config: Config) -> None:
        """Take a new config: models and their limits, the default deadline."""
        self.config = config
        self.max_message_bytes = int(config.server.max_message_mb * (1 << 20))
        self.default_timeout_s = config.queue.default_timeout_ms / 1000
        # (model, inputs) -> samples, for signatures that passed check_against_model: clients
        # send the same few again and again, and the check is pure Python.
        self._checked: dict[tuple[str, tuple[protocol.TensorMeta, ...]], int] = {}

    def bind(self, internal: dict[str, str]) -> None:
        """Bind a ROUTER on every `server.listen` endpoint (tcp ones with CURVE when it is configured),
        and on each of `internal` (protocol -> ipc:// endpoint), where each gateway sends its requests."""
        for protocol_name, endpoint in internal.items():
            socket = self._router()
            socket.setsockopt(zmq.RCVHWM, MAX_RECV_HWM)  # one connection carries a whole protocol
            # Nor may its replies be dropped at a high-water mark: each is some HTTP or gRPC client's only
            # answer, and what can queue is bounded by what admission let in.
            socket.setsockopt(zmq.SNDHWM, 0)
            self.sockets.append(socket)
            self.protocols[socket] = protocol_name
            socket.bind(endpoint)
            self._internal_paths.append(Path(endpoint[len("ipc://"):]))
            os.chmod(self._internal_paths[-1], 0o600)
            self.client_regions.add(socket, protocol_name, getattr(self.config.server, protocol_name), protocol_name,
                         gateway=True)
        for endpoint in self.config.server.listen:
            socket = self._router()
            tcp = endpoint.startswith("tcp://")
            if tcp and self._curve.enabled:
                self._curve.secure(socket)
            self.sockets.append(socket)
            socket.bind(endpoint)
            if tcp and not self._curve.enabled and not loopback(endpoint):
                log.warning("%s is reachable from the network without authentication; "
                            "set server.curve_secret_key and server.curve_authorized_keys", endpoint)
            log.info("listening on %s%s", endpoint, " (CURVE)" if tcp and self._curve.enabled else "")
            self.client_regions.add(socket, endpoint, endpoint, "zmq", gateway=False)

    def _router(self) -> zmq.Socket:
        largest, recv_hwm = receive_limits(self.config)
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.RCVHWM, recv_hwm)
        socket.setsockopt(zmq.MAXMSGSIZE, largest)
        socket.linger = 0
        return socket

    def close(self, linger_ms: int = 0) -> None:
        """Close every client socket, letting queued replies leave for at most `linger_ms`."""
        self.client_regions.close()
        for socket in self.sockets:
            socket.close(linger=linger_ms)
        for path in self._internal_paths:
            path.unlink(missing_ok=True)
        self.sockets, self.protocols, self._internal_paths = [], {}, []

    def admit(self, state: DaemonState, workers: WorkerTable) -> None:
        """Decide what is admitted from now on: nothing while the daemon starts or stops, or while no
        worker is ready; and no request for a model whose live version no ready worker has."""
        if state == DaemonState.STARTING:
            self.refusal = "the daemon is starting"
        elif state in (DaemonState.DRAINING, DaemonState.STOPPING):
            self.refusal = "the daemon is shutting down"
        elif not any(w.state == WorkerState.READY for w in workers.workers):
            self.refusal = "no worker is ready; they are restarting"
        else:
            self.refusal = None
        self.unserved = {
            name for name, version in self.live.items()
            if not any(w.serves(name, version) for w in workers.workers)
        }

    def on_readable(self, socket: zmq.Socket) -> None:
        """Read what is waiting on `socket` (up to a burst) and admit or answer each request."""
        for _ in range(BURST):
            message = recv_routed(socket)
            if message is None:
                return
            reply_to = ReplyTo(socket, message.envelope)
            try:
                self.submit(reply_to, message.body, message.first)
            except Exception:  # noqa: BLE001 - the last guard: one message never takes the daemon down
                self.send_error(reply_to, None, protocol.INTERNAL, failure("a request"))

    def submit(self, reply_to: ReplyTo, body: Sequence[Buffer], first: zmq.Frame | None = None) -> None:
        """Admit one request body, or answer it at once; every request and region message gets exactly
        one reply (a cancel has none: the request it names is answered).

        `first`: the body's first frame as received, which names its connection (for a region message).
        """
        now = time.monotonic()
        name = None
        try:
            message = protocol.decode_message(body, self.max_message_bytes)
            if isinstance(message, protocol.Cancel):
                self._cancel((id(reply_to.socket), reply_to.envelope[0]), message.id)
                return
            if not isinstance(message, protocol.Request):
                listed = self.client_regions.message(reply_to.socket, reply_to.envelope[0], message, first)
                self._send(reply_to, [protocol.encode_reply(ReplyHeader(id=message.id, status=protocol.OK,
                                                                        regions=listed))])
                return
            request = message
            header = request.header
            if header.peer is not None and reply_to.socket not in self.protocols:
                raise InvalidRequest("`peer` is for the daemon's own gateways; leave it out", header.id)
            model = self.config.models.get(header.model)
            if model is None:
                raise InvalidRequest(
                    f"unknown model {header.model!r}; this daemon serves {', '.join(sorted(self.config.models))}",
                    header.id,
                )
            name = header.model
            live = self.live.get(name, "")
            if header.version is not None and header.version != live:
                canary = self.candidates.canary_version(name)
                if header.version != canary:
                    also = f" (and {canary!r} is its canary)" if canary else ""
                    raise InvalidRequest(f"version {header.version!r} of {name} is not live; the live version is "
                                         f"{live!r}{also}", header.id)
            levels = self.queue.levels
            priority = levels.default if header.priority is None else header.priority
            if priority >= levels.count:
                raise InvalidRequest(f"priority {priority} is not a level; this daemon has levels 0 (the most "
                                     f"urgent) to {levels.count - 1}", header.id)
            signature = (name, header.inputs)
            samples = self._checked.get(signature)
            if samples is None:
                samples = check_against_model(header, name, model)
                if len(self._checked) >= SIGNATURES_KEPT:
                    self._checked.clear()
                self._checked[signature] = samples
            buffers: list[Buffer | RegionSlice] = request.buffers  # type: ignore[assignment] # None only with regions
            places: Places = ()
            if header.outputs or None in buffers:
                buffers, places = self.client_regions.resolve(reply_to.socket, reply_to.envelope[0], header,
                                                              request.buffers)
        except InvalidRequest as exc:
            log.debug("request %s invalid: %s", exc.request_id, exc.message)
            self.send_error(reply_to, exc.request_id, protocol.INVALID, exc.message, name)
            return
        if self.refusal is not None or name in self.unserved:
            refusal = self.refusal or f"no worker has {name} {self.live.get(name)} loaded yet"
            self.send_error(reply_to, header.id, protocol.UNAVAILABLE, refusal, name, priority=priority)
            return
        timeout = header.timeout_ms / 1000 if header.timeout_ms is not None else self.default_timeout_s
        client = (id(reply_to.socket), reply_to.envelope[0])
        queued = QueuedRequest(header, buffers, reply_to, client, samples, request.nbytes, now, now + timeout,
                               priority, places=places)
        finish = self.forecast.too_late(name, model.max_batch_size, priority, samples, timeout, now)
        if finish is not None:
            self.stats.deadline_refusals[name] += 1
            self.reply_error(queued, protocol.OVERLOADED,
                             f"it would finish in {finish * 1000:.0f} ms at the soonest (the work ahead of it, "
                             f"at the model's recent compute times), after its deadline in {timeout * 1000:.0f} ms")
            return
        refused = self.queue.put(queued)
        if refused in (Refusal.FULL, Refusal.BYTES):
            displaced = self.queue.displace_for(queued)
            if displaced is not None:
                for victim in displaced:
                    self.reply_error(victim, protocol.OVERLOADED,
                                     f"displaced by a more urgent request (priority {priority}) while the queue "
                                     "was full; retry later")
                refused = self.queue.put(queued)
        if refused is not None:
            self.reply_error(queued, protocol.OVERLOADED, _refusal_sentence(refused, self.queue))
            return
        self._admitted.add(name)

    def _cancel(self, client: Hashable, request_id: protocol.RequestId) -> None:
        """A client's cancel: a waiting request is answered `cancelled` now; one not waiting (maybe running,
        maybe answered already) is left to the dispatcher. The cancel itself has no reply."""
        waiting = self.queue.cancel(client, request_id)
        if waiting is not None:
            log.debug("request %s cancelled while it waited", request_id)
            self.reply_error(waiting, protocol.CANCELLED, "cancelled by its client before it ran")
        else:
            self._cancels.append((client, request_id))

    def take_cancels(self) -> list[tuple[Hashable, protocol.RequestId]]:
        """The cancels of requests that were not waiting, since the last call: (client, request id)."""
        cancels, self._cancels = self._cancels, []
        return cancels

    def note_queue_depths(self) -> None:
        """Count the queue depth of each model that took requests since the last call, for its peak:
        once per turn of the loop (the depth is highest right before batches are taken), not per request."""
        if self._admitted:
            now = time.monotonic()
            for name in self._admitted:
                self.stats.queue_depth(now, name, self.live[name], self.queue.depth(name))
            self._admitted.clear()

    def reply_ok(self, replies: Sequence[tuple[QueuedRequest, ReplyHeader, Sequence[Buffer]]],
                 by_reference: bool) -> list[zmq.MessageTracker]:
        """Send the `ok` replies of a batch: each request its header and outputs; `by_reference`:
        large outputs without a copy (see send_parts_tracked). They go out back to back, so
        ZeroMQ's I/O thread, woken by the first, finds the rest waiting and writes them together."""
        messages = [
            (request.reply_to, [*request.reply_to.envelope, protocol.encode_reply(header), *outputs])
            for request, header, outputs in replies
        ]
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

    def reply_error(self, request: QueuedRequest, status: str, error: str, version: str | None = None) -> None:
        """Answer a queued request with an error status; `version`: the one that handled it, if one did."""
        self.send_error(request.reply_to, request.header.id, status, error, request.header.model, version,
                        request.priority)

    def send_error(
        self, reply_to: ReplyTo, request_id: protocol.RequestId | None, status: str, error: str,
        model: str | None = None, version: str | None = None, priority: int | None = None,
    ) -> None:
        """Send an error reply, and count it (against its model when the model is one this daemon serves,
        and its priority level once it has one)."""
        served = model in self.live
        counted = version or (self.live[model] if model is not None and served else None)
        self.stats.reply(time.monotonic(), model if served else None, counted, status,
                         self.protocols.get(reply_to.socket), priority)
        self._send(reply_to, [protocol.error_reply(request_id, status, error, model, version)])

    def _send(self, reply_to: ReplyTo, parts: list[Buffer]) -> None:
        try:
            send_parts(reply_to.socket, [*reply_to.envelope, *parts])
        except zmq.ZMQError as exc:
            self._undeliverable(exc)

    def _undeliverable(self, exc: zmq.ZMQError) -> None:
        # EHOSTUNREACH: the client left; EAGAIN: it stopped reading. Either way the
        # reply has nowhere to go, and waiting for it would hold up everyone else.
        self.stats.undelivered += 1
        log.debug("reply undeliverable (%s)", exc.strerror)
