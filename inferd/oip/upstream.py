"""The gateway's link to the supervisor: requests in inferd's own wire protocol on an ipc:// socket,
and commands on its control socket, both from the gateway's asyncio loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import zmq
import zmq.asyncio

from inferd import protocol
from inferd.errors import InvalidRequest
from inferd.ipc.control import answer_result, decode_answer, encode_command
from inferd.oip.hop_region import HopRegion, Lease
from inferd.protocol import Buffer, ReplyHeader

log = logging.getLogger("inferd.oip.upstream")

SEND_HWM = 0  # the gateway bounds what it has in flight itself (its server's connection limits)
SWEEP_S = 1.0  # how often the requests still waiting are looked over for one past its answer's deadline


class _Waiting(NamedTuple):
    """A request sent upstream whose answer is awaited."""

    future: asyncio.Future[tuple[ReplyHeader, list[memoryview]]]
    deadline: float  # the loop's time by which its answer must have come
    limit_s: float
    what: str


class Upstream:
    """One DEALER to the supervisor's data endpoint for a protocol; replies matched to requests by id.

    A plain socket read from the loop through its file descriptor, not zmq.asyncio: its futures and
    poller callbacks cost about a fifth of the gateway's CPU per request. Sends never block (no send
    high-water mark); ZeroMQ's descriptor is edge-triggered, so every reply waiting is read whenever
    it signals, and after each send (which can take the readable edge for itself). What waits past its
    answer's deadline is found by one sweep each SWEEP_S, not by asyncio.wait_for, whose futures, timer and
    callbacks for each request held 3 to 4 % of the HTTP gateway's profile at 64 requests in flight.

    What one turn of the loop sends goes at the turn's end as one message, a group (within MAX_GROUP and
    `max_message_bytes`), and the supervisor answers in groups what one batch computed: a message's
    handling, on both sides, is shared by the requests of a turn. A request larger than that is refused
    here: ZeroMQ would drop the connection for it, and with it every reply on the way.

    The gateway's hop region (hop_region.py) is its connection's: registered once the connection is made,
    and made anew with each new connection (the supervisor closes a connection's regions when it drops, and
    the replies to requests sent on it are lost with it). A request sent through the region that comes back
    `invalid` is sent once more in frames: the region may have gone with a connection before the gateway knew."""

    def __init__(self, context: zmq.Context, endpoint: str, default_timeout_ms: int, slack_s: float,
                 max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_MB << 20) -> None:
        self._hop: HopRegion | None = None
        self._leases: dict[int, Lease] = {}  # by request: blocks of the hop region the supervisor may still use
        self._regions = itertools.count(1)  # the hop regions' names, one for each connection
        self._opening: asyncio.Task[None] | None = None
        self._default_timeout_ms = default_timeout_ms
        self._slack_s = slack_s
        self._max_message_bytes = max_message_bytes
        self._outbox: list[tuple[list[Any], int]] = []  # what this turn sent: each message's frames, its bytes
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.linger = 0
        # Before connecting, so that the first connection is reported too.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._socket.connect(endpoint)
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_soon = False
        self._sweep: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start reading replies (on the running loop), and register a hop region with each connection to the
        supervisor."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.getsockopt(zmq.FD), self._read)
        self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_connection)
        self._on_connection()  # the descriptor is edge-triggered: a connection made already has signalled

    def _on_connection(self) -> None:
        assert self._loop is not None
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._monitor.recv_multipart()
            self._hop = None  # until the new connection has its own
            self._leases.clear()  # their replies went with the old connection
            if self._opening is not None:  # its registration, and so its answer, went with the old connection
                self._opening.cancel()
            self._opening = self._loop.create_task(self._open_hop_region())

    async def _open_hop_region(self) -> None:
        """Register a new region of the gateway's own on the connection just made; without one (the supervisor
        refused it, or /dev/shm has no room), large requests' tensors go in frames."""
        try:
            try:
                region = HopRegion(f"gateway-{next(self._regions)}")
            except OSError as exc:
                log.warning("large tensors go to the supervisor in frames: no room for the gateway's region (%s)",
                            exc)
                return
            try:
                reply = await self.region(protocol.RegisterRegion, protocol.GATEWAY_PEER, name=region.name,
                                          key=region.key, byte_size=region.size)
            finally:
                region.registered()
            if reply.status != protocol.OK:
                log.warning("large tensors go to the supervisor in frames: it refused the gateway's region (%s)",
                            reply.error)
                return
            self._hop = region
        finally:
            if self._opening is asyncio.current_task():  # not one cancelled for a newer connection's
                self._opening = None

    def give_back(self) -> None:
        """Hand the system the pages of the hop region that no request uses."""
        if self._hop is not None:
            self._hop.give_back()

    async def infer(self, model: str, version: str | None,
                    inputs: Sequence[tuple[protocol.TensorMeta, Buffer | None]], timeout_ms: int | None,
                    outputs: Sequence[protocol.OutputPlace | None] = (),
                    peer: str | None = None, priority: int | None = None,
                    output_bytes: Sequence[int | None] | None = None) -> tuple[ReplyHeader, list[memoryview]]:
        """Send one request (each input's metadata and its bytes, None for one in a region, in the model's
        order; `outputs`: where to write them, if in regions; `peer`: whose regions; `priority`: inferd's
        level, None for the default); its reply. With `output_bytes` (each output's size, None where the model
        decides it), a large request of no client's region goes through the gateway's own (hop_region.py).

        Cancelled while it waits (its client went away: the HTTP connection closed, the gRPC call was
        cancelled or passed its deadline), it tells the supervisor with a Cancel, which takes the request
        out of the queue (or drops its result once its batch finishes); the supervisor's `cancelled` reply
        then finds no one waiting and is dropped."""
        request_id = next(self._ids)
        lease = None
        if self._hop is not None and output_bytes is not None and not outputs and peer is None:
            lease = self._hop.lease(inputs, output_bytes)
            if lease is not None:
                self._leases[request_id] = lease  # until the supervisor answers, even if the client has gone
        sent = (lease.inputs, lease.places, protocol.GATEWAY_PEER) if lease is not None else (inputs, outputs, peer)
        header = protocol.RequestHeader(id=request_id, model=model, version=version, timeout_ms=timeout_ms,
                                        priority=priority, inputs=tuple(meta for meta, _ in sent[0]),
                                        outputs=tuple(sent[1]), peer=sent[2])
        frames = [protocol.encode_header(header), *(data for _, data in sent[0] if data is not None)]
        size = _nbytes(frames)
        if size > self._max_message_bytes:
            return ReplyHeader(id=request_id, status=protocol.INVALID, error=(
                f"the request comes to {size} bytes as inferd's message, over server.max_message_mb "
                f"({self._max_message_bytes / (1 << 20):g} MiB); send fewer samples a request")), []
        limit_s = (timeout_ms or self._default_timeout_ms) / 1000 + self._slack_s
        reply, answered = await self._exchange(request_id, frames, limit_s, model, cancellable=True)
        if lease is None:
            return reply, answered
        if reply.status == protocol.INVALID and reply.version is None:
            # Refused before any version saw it (the region, say, unknown to a supervisor restarted meanwhile):
            # the same request in frames. One a model refused is its answer: run again, it would run twice.
            return await self.infer(model, version, inputs, timeout_ms, priority=priority)
        return lease.answer(reply, answered)

    async def region(self, kind: type[protocol.RegionOp], peer: str, **fields: Any) -> ReplyHeader:
        """Send a region message of `kind` for the client `peer`; the supervisor's answer."""
        request_id = next(self._ids)
        message = protocol.encode_op(kind(id=request_id, peer=peer, **fields))
        reply, _ = await self._exchange(request_id, [message], self._default_timeout_ms / 1000 + self._slack_s,
                                        "a region message")
        return reply

    async def _exchange(self, request_id: int, frames: list[Any], limit_s: float, what: str,
                        cancellable: bool = False) -> tuple[ReplyHeader, list[memoryview]]:
        assert self._loop is not None
        future: asyncio.Future[tuple[ReplyHeader, list[memoryview]]] = self._loop.create_future()
        # The daemon answers every request by its deadline, or once its batch is found hung; should that answer
        # never come, the sweep answers the client.
        self._waiting[request_id] = _Waiting(future, self._loop.time() + limit_s, limit_s, what)
        if self._sweep is None:
            self._sweep = self._loop.call_later(SWEEP_S, self._expire)
        try:
            self._send(frames)
            try:
                return await future
            except asyncio.CancelledError:
                # The client is gone. A cancel of a request the daemon has answered meanwhile does nothing.
                if cancellable and not self._socket.closed:
                    try:
                        self._send([protocol.encode_op(protocol.Cancel(id=request_id))])
                    except zmq.ZMQError as exc:  # shutting down: the daemon drops the request with us
                        log.debug("request %d: the cancel could not be sent (%s)", request_id, exc.strerror)
                raise
        finally:
            self._waiting.pop(request_id, None)

    def _expire(self) -> None:
        """Answer each request waiting past its answer's deadline with an error of its own; look again in
        SWEEP_S while any waits."""
        assert self._loop is not None
        now = self._loop.time()
        for request_id, waiting in list(self._waiting.items()):
            if waiting.deadline <= now and not waiting.future.done():
                log.error("request %d (%s): no answer from the supervisor within %.0f s", request_id, waiting.what,
                          waiting.limit_s)
                waiting.future.set_result((protocol.ReplyHeader(id=request_id, status=protocol.INTERNAL, error=(
                    f"the daemon did not answer within {waiting.limit_s:.0f} s (a bug; the daemon's log has "
                    "more)")), []))
        self._sweep = self._loop.call_later(SWEEP_S, self._expire) if self._waiting else None

    def _send(self, frames: list[Any]) -> None:
        """Send `frames` at the end of this turn of the loop, with whatever else the turn sends."""
        assert self._loop is not None
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append((frames, _nbytes(frames)))

    def _flush(self) -> None:
        assert self._loop is not None
        messages, self._outbox = self._outbox, []
        while messages:
            count, size = 0, 0
            while count < min(len(messages), protocol.MAX_GROUP) and (
                    not count or size + messages[count][1] <= self._max_message_bytes):
                size += messages[count][1]
                count += 1
            some, messages = messages[:count], messages[count:]
            frames = some[0][0] if count == 1 else protocol.encode_group([frames for frames, _ in some])
            self._socket.send_multipart(frames, copy=False)
        if not self._read_soon:
            self._read_soon = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._read_soon = False
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            body = [frame.buffer for frame in self._socket.recv_multipart(copy=False)]
            try:
                replies = protocol.group_of(body, sys.maxsize) or [body]
            except InvalidRequest as exc:
                log.warning("malformed group of replies from the supervisor dropped: %s", exc)
                continue
            for reply in replies:
                self._answer(reply)

    def _answer(self, reply: Sequence[Buffer]) -> None:
        try:
            header = protocol.decode_reply_header(reply[0])
        except msgspec.DecodeError:
            log.warning("malformed reply from the supervisor dropped")
            return
        if self._leases and isinstance(header.id, int):
            self._leases.pop(header.id, None)
        waiting = self._waiting.get(header.id) if isinstance(header.id, int) else None
        if waiting is not None and not waiting.future.done():
            waiting.future.set_result((header, [memoryview(frame) for frame in reply[1:]]))

    def close(self) -> None:
        """Stop reading and close the socket; whoever still waits gets CancelledError."""
        if self._loop is not None:
            self._loop.remove_reader(self._socket.getsockopt(zmq.FD))
            self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
        if self._sweep is not None:
            self._sweep.cancel()
        for waiting in self._waiting.values():
            waiting.future.cancel()
        self._leases.clear()
        if self._opening is not None:
            self._opening.cancel()
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()


def _nbytes(frames: Sequence[Any]) -> int:
    # Bytes, not len(): a tensor decoded from nested JSON is a buffer of more than one dimension.
    return sum(memoryview(frame).nbytes for frame in frames)


class Control:
    """Commands on the supervisor's control socket (status, health, models, stats), one at a time."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, timeout_s: float = 5.0) -> None:
        self._context = context
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._socket: zmq.asyncio.Socket | None = None

    async def call(self, command: str, **args: Any) -> Any:
        """The command's result; ConnectionError with a sentence when the supervisor does not answer (or
        refuses)."""
        async with self._lock:
            if self._socket is None:
                self._socket = self._connect()
            try:
                answer = await self._exchange(self._socket, command, args)
            except ConnectionError:
                # The answer may still come: a new socket, so it is not taken for the next one's.
                self._socket.close()
                self._socket = None
                raise
        return answer_result(command, answer, ConnectionError)

    async def call_long(self, command: str, refused: type[Exception], **args: Any) -> Any:
        """`call` for a command that may take long (load): on a socket of its own, so the quick commands of
        other requests do not wait behind it, and waited for as long as its progress answers say."""
        socket = self._connect()
        try:
            answer = await self._exchange(socket, command, args)
        finally:
            socket.close()
        return answer_result(command, answer, refused)

    def _connect(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.linger = 0
        socket.connect(self._endpoint)
        return socket

    async def _exchange(self, socket: zmq.asyncio.Socket, command: str, args: dict[str, Any]) -> Any:
        """Send `command` and return its final answer, read past its progress answers."""
        await socket.send(encode_command(command, **args))
        wait_s = self._timeout_s
        while True:
            if not await socket.poll(int(wait_s * 1000)):
                raise ConnectionError(f"the daemon did not answer {command} within {wait_s:g} s")
            answer = decode_answer(await socket.recv())
            if answer.progress is None:
                return answer
            wait_s = self._timeout_s + (answer.wait_s or 0.0)

    def close(self) -> None:
        """Close the socket."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
