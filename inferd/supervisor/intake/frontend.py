"""The frontend: the ROUTER sockets clients talk to, and admission.

It decodes and validates each request, and puts it in the RequestQueue or
refuses it at once (`invalid`, `overloaded`, `unavailable`) through replies.py,
where every reply leaves. Admission is decided here: whether the daemon takes
requests at all, which models no worker serves yet, the bounds of the queue
(where an urgent request may displace a less urgent one), and whether a request
could still finish before its deadline. A cancel takes its request out of the
queue, or marks it in its running batch (through the dispatcher's
`cancel_running`). Region messages and requests that name clients'
shared-memory regions go to client_regions.py; what ZeroMQ may hold of a
connection's requests before they are read, to receive_limits.py; the sockets'
monitors (connections open, and those that cannot be accepted), to
connections.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import zmq

from inferd import protocol
from inferd.config.schema import Config, ModelConfig
from inferd.errors import InvalidRequest, Overloaded
from inferd.ipc.addresses import loopback
from inferd.ipc.curve import CurveServer
from inferd.ipc.messages import TensorSpec
from inferd.ipc.sockets import bind_error, recv_routed
from inferd.protocol import Buffer, ReplyHeader
from inferd.supervisor.dispatch.replies import Replies, ReplyTo
from inferd.supervisor.intake.client_regions import ClientRegions, Places
from inferd.supervisor.intake.connections import Connections
from inferd.supervisor.intake.forecast import Forecast
from inferd.supervisor.intake.receive_limits import largest_message, receive_mark
from inferd.supervisor.pipelines.graph import Graph
from inferd.supervisor.pipelines.runner import Pipelines
from inferd.supervisor.processes.workers import WorkerState, WorkerTable
from inferd.supervisor.queueing.padding import output_bytes
from inferd.supervisor.queueing.queue import QueuedRequest, RequestQueue, Shapes, displaced_sentence
from inferd.supervisor.queueing.request_checks import check_against_model
from inferd.supervisor.shared.backstop import failure
from inferd.supervisor.shared.candidates import Candidates
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.regions import Regions, RegionSlice
from inferd.supervisor.shared.state import DaemonState, StartupError
from inferd.supervisor.shared.stats import Stats

log = logging.getLogger("inferd.frontend")

BURST = 256  # messages read per readiness, so one busy socket cannot starve the others
# A client that stops reading gets this many replies queued, then its replies are
# dropped (and counted): its memory cost to the daemon is bounded.
SEND_HWM = 1000
MAX_RECV_HWM = 1000  # and a client that floods small requests gets TCP backpressure, not daemon memory
SIGNATURES_KEPT = 1024  # input signatures remembered as checked, per config


class Frontend:
    """Client-facing sockets and request admission."""

    def __init__(self, context: zmq.Context, config: Config, queue: RequestQueue, replies: Replies, stats: Stats,
                 live: LiveVersions, candidates: Candidates, curve: CurveServer, regions: Regions,
                 forecast: Forecast, cancel_running: Callable[[Hashable, protocol.RequestId], bool],
                 signature: Callable[[str, str], tuple[TensorSpec, ...] | None], pipelines: Pipelines) -> None:
        self.queue = queue
        self.pipelines = pipelines
        self.replies = replies
        self.forecast = forecast
        self.stats = stats
        self.live = live
        self.candidates = candidates
        self.sockets: list[zmq.Socket] = []
        self.listening: list[str] = []  # the server.listen endpoints as bound
        self._internal_paths: list[Path] = []  # their ipc socket files, removed at close
        self.refusal: str | None = "the daemon is starting"
        self.unserved: set[str] = set()  # models no ready worker has loaded yet
        self.unloadable: dict[str, str] = {}  # on-demand models refused while their load's backoff runs: why
        # While they are unserved, when a worker is expected to be ready again (None: none can come), and why.
        self.back_at: float | None = None
        self.back_why = ""
        self.any_ready = False
        self._admitted: set[str] = set()  # models that took requests since note_queue_depths
        self._cancel_running = cancel_running
        self._signature = signature  # a version's outputs, once a worker has loaded it
        self._context = context
        self._curve = curve
        self._receive_mark: int | None = None  # the client sockets' mark, once they are bound
        self.configure(config)
        self.connections = Connections(regions)
        self.client_regions = ClientRegions(regions, config.server, self.connections)

    def configure(self, config: Config) -> None:
        """Take a new config: models and their limits, the default deadline."""
        self.config = config
        self.max_message_bytes = int(config.server.max_message_mb * (1 << 20))
        self.default_timeout_s = config.queue.default_timeout_ms / 1000
        mark = receive_mark(config)
        if self._receive_mark is not None and mark != self._receive_mark:
            log.warning("ZeroMQ's receive high-water mark stays %d messages per connection until a restart; the "
                        "queue's bounds and the models now give %d (docs/operations/memory.md)",
                        self._receive_mark, mark)
        # (model, inputs) -> what check_against_model found, for signatures that passed it: clients
        # send the same few again and again, and the check is pure Python.
        self._checked: dict[tuple[str, tuple[protocol.TensorMeta, ...]], tuple[int, Shapes, int | None]] = {}

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
            self.replies.add_gateway(socket, protocol_name)
            socket.bind(endpoint)
            self._internal_paths.append(Path(endpoint[len("ipc://"):]))
            os.chmod(self._internal_paths[-1], 0o600)
            self.client_regions.add(socket, protocol_name, getattr(self.config.server, protocol_name), protocol_name,
                                    gateway=True)
        self._receive_mark = receive_mark(self.config)
        for endpoint in self.config.server.listen:
            socket = self._router()
            socket.setsockopt(zmq.RCVHWM, self._receive_mark)  # before it binds: see receive_limits.py
            tcp = endpoint.startswith("tcp://")
            if tcp and self._curve.enabled:
                self._curve.secure(socket)
            self.sockets.append(socket)
            self.connections.count(socket)
            try:
                socket.bind(endpoint)
            except zmq.ZMQError as exc:
                raise StartupError(f"cannot listen at {endpoint} ({bind_error(exc)}); change "
                                   "server.listen") from None
            bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # port 0: the one the system picked
            self.listening.append(bound)
            if tcp and not self._curve.enabled and not loopback(endpoint):
                log.warning("%s is reachable from the network without authentication; "
                            "set server.curve_secret_key and server.curve_authorized_keys", bound)
            log.info("listening on %s%s", bound, " (CURVE)" if tcp and self._curve.enabled else "")
            self.client_regions.add(socket, bound, bound, "zmq", gateway=False)

    def _router(self) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, largest_message(self.config))
        socket.linger = 0
        return socket

    def close(self, linger_ms: int = 0) -> None:
        """Close every client socket, letting queued replies leave for at most `linger_ms`."""
        self.connections.close()
        self.client_regions.close()
        for socket in self.sockets:
            socket.close(linger=linger_ms)
        for path in self._internal_paths:
            path.unlink(missing_ok=True)
        self.sockets, self._internal_paths = [], []

    def admit(self, state: DaemonState, workers: WorkerTable, unloadable: dict[str, str]) -> None:
        """Decide what is admitted from now on: nothing while the daemon starts or stops. A model whose
        live version no ready worker has (they are restarting) takes requests that can wait for the first
        worker expected back: a restart's backoff, then as long as that worker's last start took. An
        on-demand model takes requests while any worker is ready (they wait for its load), except those of
        `unloadable`, whose last load failed: model -> why."""
        if state == DaemonState.STARTING:
            self.refusal = "the daemon is starting"
        elif state in (DaemonState.DRAINING, DaemonState.STOPPING):
            self.refusal = "the daemon is shutting down"
        else:
            self.refusal = None
        self.any_ready = any(w.state == WorkerState.READY for w in workers.workers)
        self.unserved = {
            name for name, version in self.live.items()
            if not any(w.serves(name, version) for w in workers.workers)
            and not (self.any_ready and self.config.models[name].on_demand)
        }
        self.unloadable = unloadable
        now = time.monotonic()
        coming = [(back, w) for w in workers.workers if w.state != WorkerState.READY
                  and (back := w.expected_back(now)) is not None]
        self.back_at, self.back_why = None, ""
        if coming:
            self.back_at, worker = min(coming, key=lambda c: c[0])
            self.back_why = (f"{worker.name} is expected back in {max(0.0, self.back_at - now):.1f} s "
                             f"(its restart's wait, then its last start's {worker.boot_s:.1f} s)")

    def on_readable(self, socket: zmq.Socket) -> None:
        """Read what is waiting on `socket` (up to a burst) and admit or answer each request."""
        for _ in range(BURST):
            message = recv_routed(socket)
            if message is None:
                return
            reply_to = ReplyTo(socket, message.envelope)
            try:
                members = protocol.group_of(message.body, self.max_message_bytes)
            except InvalidRequest as exc:
                self.replies.refuse(reply_to, None, protocol.INVALID, exc.message)
                continue
            for body in members or (message.body,):
                try:
                    self.submit(reply_to, body, message.first, grouped=members is not None)
                except Exception:  # noqa: BLE001 - the last guard: one message never takes the daemon down
                    self.replies.refuse(reply_to, None, protocol.INTERNAL, failure("a request"))

    def submit(self, reply_to: ReplyTo, body: Sequence[Buffer], first: zmq.Frame | None = None,
               grouped: bool = False) -> None:
        """Admit one request body, or answer it at once; every request and region message gets exactly
        one reply (a cancel has none: the request it names is answered).

        `first`: the body's first frame as received, which names its connection (for a region message);
        `grouped`: the request came in a group, and its client takes replies in groups too.
        """
        now = time.monotonic()
        name = named = None  # the model and version it asks for, once read
        try:
            message = protocol.decode_message(body, self.max_message_bytes)
            if isinstance(message, protocol.Cancel):
                self._cancel(reply_to.connection, message.id)
                return
            if not isinstance(message, protocol.Request):
                try:
                    listed = self.client_regions.message(reply_to.socket, reply_to.envelope[0], message, first)
                except Overloaded as exc:
                    self.replies.refuse(reply_to, exc.request_id, protocol.OVERLOADED, exc.message)
                    return
                self.replies.send(reply_to, [protocol.encode_reply(ReplyHeader(id=message.id, status=protocol.OK,
                                                                               regions=listed))])
                return
            request = message
            header = request.header
            if header.peer is not None and reply_to.socket not in self.replies.protocols:
                raise InvalidRequest("`peer` is for the daemon's own gateways; leave it out", header.id)
            graph = self.pipelines.graphs.get(header.model)
            if graph is not None:
                self._start_pipeline(reply_to, request, graph, now)
                return
            model = self.config.models.get(header.model)
            if model is None:
                pipelines = f" and the pipelines {', '.join(sorted(self.pipelines.graphs))}" if self.pipelines.graphs \
                    else ""
                raise InvalidRequest(f"unknown model {header.model!r}; this daemon serves "
                                     f"{', '.join(sorted(self.config.models))}{pipelines}", header.id)
            name, named = header.model, header.version
            live = self.live.get(name, "")
            if header.version is not None and header.version != live:
                canary = self.candidates.canary_version(name)
                if header.version != canary:
                    also = f" (and {canary!r} is its canary)" if canary else ""
                    raise InvalidRequest(f"version {header.version!r} of {name} is not live; the live version is "
                                         f"{live!r}{also}", header.id)
            priority = self._priority(header)
            samples, shapes, elements = self._check(header, name, model)
            buffers: list[Buffer | RegionSlice] = request.buffers  # type: ignore[assignment] # None only with regions
            places: Places = ()
            if header.outputs or None in buffers:
                buffers, places = self.client_regions.resolve(reply_to.socket, reply_to.envelope[0], header,
                                                              request.buffers)
                self._check_room_for_outputs(header, name, model, samples, places)
        except InvalidRequest as exc:
            log.debug("request %s invalid: %s", exc.request_id, exc.message)
            self.replies.refuse(reply_to, exc.request_id, protocol.INVALID, exc.message, name, named=named)
            return
        timeout = self._timeout(header)
        refusal = self.refusal or self._unavailable(name, now + timeout)
        if refusal is not None:
            self.replies.refuse(reply_to, header.id, protocol.UNAVAILABLE, refusal, name, priority=priority,
                                named=named)
            return
        client = reply_to.connection
        queued = QueuedRequest(header, buffers, reply_to, client, samples, request.nbytes, now, now + timeout,
                               priority, places=places, shapes=shapes, grouped=grouped)
        finish = self.forecast.too_late(name, model.max_batch_size, priority, samples, timeout, now, elements)
        if finish is not None:
            self.stats.deadline_refusals[name] += 1
            self.replies.error(queued, protocol.OVERLOADED,
                               f"it would finish in {finish * 1000:.0f} ms at the soonest (the work ahead of it, "
                               f"at the model's recent compute times), after its deadline in {timeout * 1000:.0f} ms")
            return
        refused, displaced = self.queue.admit(queued)
        for victim in displaced:
            self.replies.error(victim, protocol.OVERLOADED, displaced_sentence(priority))
        if refused is not None:
            self.replies.error(queued, protocol.OVERLOADED, self.queue.refusal_sentence(refused))
            return
        self._admitted.add(name)

    def _priority(self, header: protocol.RequestHeader) -> int:
        """The request's priority level (InvalidRequest if it names none this daemon has)."""
        levels = self.queue.levels
        priority = levels.default if header.priority is None else header.priority
        if priority >= levels.count:
            raise InvalidRequest(f"priority {priority} is not a level; this daemon has levels 0 (the most "
                                 f"urgent) to {levels.count - 1}", header.id)
        return priority

    def _check(self, header: protocol.RequestHeader, name: str, model: ModelConfig) -> tuple[int, Shapes, int | None]:
        """check_against_model, remembered for the signatures that passed it."""
        signature = (name, header.inputs)
        checked = self._checked.get(signature)
        if checked is None:
            checked = check_against_model(header, name, model)
            if len(self._checked) >= SIGNATURES_KEPT:
                self._checked.clear()
            self._checked[signature] = checked
        return checked

    def _timeout(self, header: protocol.RequestHeader) -> float:
        return header.timeout_ms / 1000 if header.timeout_ms is not None else self.default_timeout_s

    def _unavailable(self, name: str, deadline: float) -> str | None:
        """Why a request of model `name` due by `deadline` cannot be served (no worker will have the model in
        time), or None."""
        if name in self.unloadable:
            return self.unloadable[name]
        if name not in self.unserved or (self.back_at is not None and deadline >= self.back_at):
            return None
        live = self.live.get(name)
        return (f"no worker serves {name} {live} now, and none will before the request's deadline: {self.back_why}"
                if self.back_at is not None else f"no worker has {name} {live} loaded yet" if self.any_ready else
                f"no worker serves {name} {live}, and none is coming back: every worker was given up")

    def _start_pipeline(self, reply_to: ReplyTo, request: protocol.Request, graph: Graph, now: float) -> None:
        """Check a request of a pipeline and hand it to the pipelines, or answer it at once."""
        header = request.header
        if header.version is not None:
            raise InvalidRequest(f"{graph.name} is a pipeline, which has no versions of its own (its reply's version "
                                 "names its steps'); leave version out", header.id)
        if header.outputs or None in request.buffers:
            raise InvalidRequest(f"{graph.name} is a pipeline: its inputs come in the request's message and its "
                                 "outputs in the reply, not in shared-memory regions", header.id)
        priority = self._priority(header)
        self._check(header, graph.name, graph.inputs)
        deadline = now + self._timeout(header)
        refusal = self.refusal or next((f"pipeline {graph.name}, step {step.title}: {why}" for step in graph.steps
                                        if (why := self._unavailable(step.model, deadline)) is not None), None)
        if refusal is not None:
            self.replies.refuse(reply_to, header.id, protocol.UNAVAILABLE, refusal, priority=priority)
            return
        self.pipelines.start(reply_to, header, request.buffers, now, deadline, priority)  # type: ignore[arg-type]

    def _check_room_for_outputs(self, header: protocol.RequestHeader, name: str, model: ModelConfig, samples: int,
                                places: Places) -> None:
        """InvalidRequest if a region the request places an output in cannot hold it, checked before it is
        computed wherever its size is known then: the outputs of the version it names, else of the live one,
        once a worker has loaded it. (A canary whose outputs differ, by --allow-signature-change, is checked
        as its reply is written.)"""
        version = header.version or self.live.get(name, "")
        outputs = self._signature(name, version) or ()
        for index, (place, _) in enumerate(zip(places, outputs)):
            if place is None or place.limit is not None:  # one with a limit comes in a frame where it is larger
                continue
            size = output_bytes(model, outputs, index, header.inputs, samples)
            if size is None:
                continue
            try:
                place.region.check(place.offset, size, f"output {index} of {name} {version}")
            except InvalidRequest as exc:
                raise InvalidRequest(exc.message, header.id) from None

    def _cancel(self, client: Hashable, request_id: protocol.RequestId) -> None:
        """A client's cancel: a waiting request is answered `cancelled` now; a running one is marked in
        its batch, to be answered `cancelled` when the batch comes back; one answered already is left be.
        The cancel itself has no reply."""
        if self.pipelines.cancel(client, request_id):
            return
        waiting = self.queue.cancel(client, request_id)
        if waiting is not None:
            log.debug("request %s cancelled while it waited", request_id)
            self.replies.error(waiting, protocol.CANCELLED, "cancelled by its client before it ran")
        else:
            self._cancel_running(client, request_id)

    def note_queue_depths(self) -> None:
        """Count the queue depth of each model that took requests since the last call, for its peak:
        once per turn of the loop (the depth is highest right before batches are taken), not per request."""
        if self._admitted:
            now = time.monotonic()
            for name in self._admitted:
                self.stats.queue_depth(now, name, self.live[name], self.queue.depth(name))
            self._admitted.clear()
