"""Replies: every answer a client gets leaves from here, and is counted here.

The frontend hands over what it refuses at the door, the loop what expired in
the queue or was left at a forced stop, the dispatcher what a batch came back
with. A computed request's reply carries its rows of every output, sliced from
the arena slot (large ones without a copy: ZeroMQ's trackers say when the slot
may be reused), or written into the client's own region where it placed them.
Sending never blocks: a reply that cannot be delivered (peer gone, or its
high-water mark reached) is counted and dropped, so one slow client cannot
block the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import zmq

from inferd import protocol
from inferd.errors import InvalidRequest
from inferd.ipc.messages import BatchDone, TensorRef
from inferd.ipc.sockets import send_parts, send_parts_tracked
from inferd.protocol import Buffer, ReplyHeader, TensorMeta, Timing
from inferd.supervisor.dispatch.batch import Batch
from inferd.supervisor.queueing import padding
from inferd.supervisor.queueing.queue import QueuedRequest
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.regions import Place
from inferd.supervisor.shared.stats import Stats

log = logging.getLogger("inferd.replies")

EXPIRED_ERROR = "the deadline passed before the request ran"
LATE_ERROR = "the deadline passed before its batch finished; the result is dropped"
CANCELLED_ERROR = "cancelled while its batch ran; the result was dropped"


class ReplyTo(NamedTuple):
    """Where a reply goes: the socket the request came on and its routing envelope."""

    socket: zmq.Socket
    envelope: list[bytes]

    @property
    def connection(self) -> tuple[int, bytes]:
        """The client connection it names: the socket and the peer's routing id (what the queue's
        per-client bounds and a cancel go by)."""
        return id(self.socket), self.envelope[0]


class StepOf(Protocol):
    """Where the answer to a request a pipeline made for one of its steps goes: back to its pipeline, not to a
    socket (the pipeline answers its client, through `Replies.pipeline`)."""

    def computed(self, request: QueuedRequest, outputs: tuple[TensorMeta, ...], frames: Sequence[Buffer],
                 version: str, wait_s: float, compute_s: float) -> None:
        """The step computed `request`: its outputs, their bytes (valid only during the call), the version
        that computed it, how long it waited and its batch's compute time."""

    def failed(self, request: QueuedRequest, status: str, error: str, version: str) -> None:
        """The step answered `request` with an error (of `version`, or the live one where none ran it)."""


class Replies:
    """Sends every reply and counts it: by status, model, version, priority and protocol."""

    def __init__(self, stats: Stats, live: LiveVersions) -> None:
        self.stats = stats
        self.live = live
        self.protocols: dict[zmq.Socket, str] = {}  # the gateways' sockets -> the protocol each carries

    def add_gateway(self, socket: zmq.Socket, protocol_name: str) -> None:
        """`socket` carries one gateway's requests: its replies are counted under `protocol_name`."""
        self.protocols[socket] = protocol_name

    def send(self, reply_to: ReplyTo, parts: Sequence[Buffer]) -> None:
        """Send an already encoded reply (the frontend's answers to region messages)."""
        try:
            send_parts(reply_to.socket, [*reply_to.envelope, *parts])
        except zmq.ZMQError as exc:
            self._undeliverable(exc)

    def refuse(
        self, reply_to: ReplyTo, request_id: protocol.RequestId | None, status: str, error: str,
        model: str | None = None, version: str | None = None, priority: int | None = None,
        named: str | None = None,
    ) -> None:
        """Send an error reply, and count it (against its model when the model is one this daemon serves,
        and its priority level once it has one). `version`: the one that handled it, if one did; `named`:
        the one the request asked for, if it did."""
        served = model if model is not None and model in self.live else None
        counted = self._counted_version(served, version, named) if served is not None else None
        self.stats.reply(time.monotonic(), served, counted, status, self.protocols.get(reply_to.socket), priority)
        self.send(reply_to, [protocol.error_reply(request_id, status, error, model, version)])

    def _counted_version(self, model: str, version: str | None, named: str | None) -> str:
        """The version an error reply of `model` is counted against: the one the request named, where the
        daemon knows that one (live, live before the last reload, or counted against already: never a name
        a client made up, which would make a row of the stats and a series of the metrics of its own), else
        the one that handled it, else the live one."""
        if named is not None and (named in (self.live[model], self.live.previous(model))
                                  or (model, named) in self.stats.since_start):
            return named
        return version or self.live[model]

    def error(self, request: QueuedRequest, status: str, error: str, version: str | None = None) -> None:
        """Answer a queued request with an error status; `version`: the one that handled it, if one did. A
        pipeline's step request is answered to its pipeline (and counted against its model)."""
        if type(request.reply_to) is not ReplyTo:
            model = request.header.model
            handled = version or self.live[model]
            self.stats.reply(time.monotonic(), model, handled, status, None, request.priority, step=True)
            request.reply_to.failed(request, status, error, handled)
            return
        self.refuse(request.reply_to, request.header.id, status, error, request.header.model, version,
                    request.priority, request.header.version)

    def timed_out(self, request: QueuedRequest, version: str | None = None) -> None:
        """Answer a request whose deadline passed before it ran: in the queue, or (with the `version`
        its batch was for) while its batch waited for its executor."""
        self.error(request, protocol.TIMEOUT, EXPIRED_ERROR, version)

    def late(self, request: QueuedRequest, version: str) -> None:
        """Answer `timeout` at its deadline a request whose batch (of `version`) still runs; what the batch
        brings back for it is dropped."""
        request.answered = True
        self.error(request, protocol.TIMEOUT, LATE_ERROR, version)

    def failed(self, batch: Batch, reason: str, status: str = protocol.INTERNAL) -> None:
        """Answer every request of a batch that did not compute with `status` (those answered at their
        deadline have had their reply)."""
        log.error("%s (%d requests) failed: %s", batch.describe(), len(batch.requests), reason)
        for request in batch.requests:
            if not request.answered:
                self.error(request, status, reason, batch.version)

    def computed(self, batch: Batch, done: BatchDone, by_reference: bool) -> list[zmq.MessageTracker]:
        """Send each computed request its rows of every output (with `by_reference`, large ones without
        a copy: their trackers are returned), each expired one `timeout` (and one whose deadline passed while
        its batch computed: no `ok` leaves after a deadline), each cancelled one `cancelled`, each that raised
        when its batch was run one request at a time its own error; one answered at its deadline already gets
        nothing more."""
        buf = batch.executor.worker.arena.buf
        sizes = [_row_bytes(ref) for ref in done.outputs]
        now = time.monotonic()
        expired = set(done.expired)
        failed = {each.index: each for each in done.failed}
        # Requests of a batch mostly carry the same sample count: their output metadata is shared.
        metas: dict[int, tuple[TensorMeta, ...]] = {}
        replies: list[tuple[QueuedRequest, list[Buffer]]] = []
        computed = []
        row = late = steps = 0
        for index, request in enumerate(batch.requests):
            if index in expired:
                if not request.answered:
                    self.timed_out(request, batch.version)
                continue
            samples = request.samples
            # Its rows: of the batch's outputs, after those of the requests before it; or, where the batch was
            # run one request at a time, its own outputs.
            refs, at = (done.each[index], 0) if done.each else (done.outputs, row)
            row += samples
            if index in failed:
                if not request.answered:
                    self.error(request, failed[index].status, failed[index].error, batch.version)
                continue
            if request.answered:
                continue
            if now > request.deadline:  # back before the loop saw the deadline pass: the same answer
                self.late(request, batch.version)
                late += 1
                continue
            if request.cancelled:
                self.error(request, protocol.CANCELLED, CANCELLED_ERROR, batch.version)
                continue
            if done.each:
                own = [_row_bytes(ref) for ref in refs]
                outputs = tuple(TensorMeta(ref.dtype, ref.shape) for ref in refs)
            else:
                own = sizes
                shared = metas.get(samples)
                if shared is None:
                    shared = metas[samples] = tuple(TensorMeta(ref.dtype, (samples, *ref.shape[1:])) for ref in refs)
                outputs = shared
            frames = [buf[ref.offset + at * size : ref.offset + (at + samples) * size] if size is not None
                      else _rows(buf, ref, at, samples) for ref, size in zip(refs, own)]
            if batch.cuts:  # its inputs were padded: the outputs that follow them are cut back to its own size
                cut_back = list(outputs)
                for cut in batch.cuts:
                    ref = refs[cut.output]
                    cut_back[cut.output], frames[cut.output] = padding.cut_rows(
                        frames[cut.output], ref.dtype, (samples, *ref.shape[1:]), cut, request)
                outputs = tuple(cut_back)
            if type(request.reply_to) is not ReplyTo:  # a pipeline's step: its outputs go on to its next steps
                request.reply_to.computed(request, outputs, frames, batch.version, batch.started - request.received,
                                          done.compute_us / 1e6)
                computed.append(request)
                steps += 1
                continue
            if request.places:
                try:
                    outputs, frames = _write_placed(request.places, outputs, frames)
                except InvalidRequest as exc:
                    self.error(request, protocol.INVALID, exc.message, batch.version)
                    continue
            timing = Timing(queue=int((batch.started - request.received) * 1e6), compute=done.compute_us,
                            total=int((now - request.received) * 1e6))
            header = ReplyHeader(id=request.header.id, status=protocol.OK, model=batch.model,
                                 version=batch.version, outputs=outputs, timing_us=timing)
            replies.append((request, [protocol.encode_reply(header), *frames]))
            computed.append(request)
        if expired:
            log.info("%s: %d request(s) not computed, their deadline passed while the batch waited for "
                     "its executor", batch.describe(), len(expired))
        if failed:
            log.info("%s: %d of its %d request(s) raised, each alone, and got its own error", batch.describe(),
                     len(failed), len(batch.requests))
        if late:
            log.info("%s: %d request(s) answered timeout, the batch finished after their deadline", batch.describe(),
                     late)
        if not computed:
            return []
        trackers = self._send_all(replies, by_reference)
        if self.protocols:  # some came through a gateway: count them by protocol
            for request in computed:
                gateway = self.protocols.get(request.reply_to.socket) if type(request.reply_to) is ReplyTo else None
                if gateway is not None:
                    self.stats.by_protocol[(batch.model, gateway, protocol.OK)] += 1
        self.stats.answered(now, batch.model, batch.version, sum(r.samples for r in computed),
                            [now - r.received for r in computed], [batch.started - r.received for r in computed],
                            done.compute_us / 1e6, [r.priority for r in computed], [us / 1e6 for us in done.phases_us],
                            steps)
        return trackers

    def pipeline(self, reply_to: ReplyTo, pipeline: str, header: ReplyHeader, frames: Sequence[Buffer],
                 total_s: float = 0.0, samples: int = 0) -> None:
        """Send a pipeline's reply (its outputs, or the error of the step that failed), and count it against the
        pipeline: an `ok` one with its `samples`, its `total_s` and its steps' wait and compute (its timing)."""
        now = time.monotonic()
        self.stats.reply(now, pipeline, None, header.status, self.protocols.get(reply_to.socket))
        series = self.stats.pipeline(pipeline)
        series.replies[header.status] += 1
        if header.status == protocol.OK:
            series.total.add(total_s)
            series.samples += samples
            if header.timing_us is not None:
                series.queue_s += header.timing_us.queue / 1e6
                series.compute_s += header.timing_us.compute / 1e6
            series.last_answered = now
        self.send(reply_to, [protocol.encode_reply(header), *frames])

    def _send_all(self, replies: list[tuple[QueuedRequest, list[Buffer]]],
                  by_reference: bool) -> list[zmq.MessageTracker]:
        """Send a batch's `ok` replies back to back, so ZeroMQ's I/O thread, woken by the first, finds the
        rest waiting and writes them together; those to one connection of requests that came in groups, as
        one group; `by_reference`: large outputs without a copy (see send_parts_tracked)."""
        messages: dict[tuple[int, bytes], tuple[ReplyTo, list[list[Buffer]]]] = {}
        for request, body in replies:
            key = request.reply_to.connection if request.grouped else (id(request), b"")
            messages.setdefault(key, (request.reply_to, []))[1].append(body)
        trackers: list[zmq.MessageTracker] = []
        for reply_to, bodies in messages.values():
            for at in range(0, len(bodies), protocol.MAX_GROUP):
                some = bodies[at:at + protocol.MAX_GROUP]
                parts = [*reply_to.envelope, *(some[0] if len(some) == 1 else protocol.encode_group(some))]
                try:
                    if by_reference:
                        trackers += send_parts_tracked(reply_to.socket, parts)
                    else:
                        send_parts(reply_to.socket, parts)
                except zmq.ZMQError as exc:
                    self._undeliverable(exc)
        return trackers

    def _undeliverable(self, exc: zmq.ZMQError) -> None:
        # EHOSTUNREACH: the client left; EAGAIN: it stopped reading. Either way the
        # reply has nowhere to go, and waiting for it would hold up everyone else.
        self.stats.undelivered += 1
        log.debug("reply undeliverable (%s)", exc.strerror)


def _write_placed(places: tuple[Place | None, ...], metas: tuple[TensorMeta, ...],
                  frames: list[memoryview]) -> tuple[tuple[TensorMeta, ...], list[memoryview]]:
    """Write the outputs a request placed in its regions there (one larger than its place's limit stays a
    frame): the reply's output metadata (saying where each was written) and the frames left to send."""
    if len(places) > len(metas):
        raise InvalidRequest(f"the request places {len(places)} outputs, but the model has {len(metas)}")
    described, left = [], []
    for index, (meta, frame) in enumerate(zip(metas, frames)):
        place = places[index] if index < len(places) else None
        if place is None or (place.limit is not None and len(frame) > place.limit):
            described.append(meta)
            left.append(frame)
            continue
        region, offset, _ = place
        region.write_from([frame], offset)
        described.append(TensorMeta(meta.dtype, meta.shape, region.name, offset,
                                    len(frame) if meta.dtype == protocol.BYTES else None))
    return tuple(described), left


def _row_bytes(ref: TensorRef) -> int | None:
    """The bytes of one sample of an output (None for BYTES, whose samples end where its `ends` say)."""
    return None if ref.dtype == protocol.BYTES else protocol.tensor_bytes(ref.dtype, ref.shape[1:])


def _rows(buf: memoryview, ref: TensorRef, first: int, count: int) -> memoryview:
    """Samples `first` to `first + count` of a BYTES output."""
    start, end = ref.rows(first, count)
    return buf[start:end]
