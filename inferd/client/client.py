"""Python clients of inferd: `Client` (threads) and `AsyncClient` (asyncio).

A client keeps many requests in flight and matches replies by id. It takes one
endpoint, several, or a host name that resolves to several (endpoints.py
spreads the requests and tracks each daemon's health). `timeout` is a call's
whole deadline, retries included; each attempt sends the time left as the
header's `timeout_ms`. Retries happen on `overloaded`, `unavailable` and on a
reply lost because a connection dropped, with exponential backoff and jitter,
on another endpoint where there is one, and never once the deadline cannot be
met. A retry reuses the request id, so whichever reply arrives first wins.
A call's `priority` (the client's by default) orders it in the daemon's queue.
Cancelling a call's future (or an asyncio task awaiting it) sends the daemon a
cancel, which takes the request out of its queue or drops its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd import curve, protocol
from inferd.curve import KeyFile
from inferd.endpoints import Endpoint, EndpointPool, Resolver
from inferd.errors import ERROR_BY_STATUS, InferdError, Timeout, Unavailable
from inferd.shared_memory import SharedMemoryRegion
from inferd.shm_names import CLIENT_PREFIX

Array = Any  # a numpy array, or a torch tensor on any device
Outputs = np.ndarray | tuple[np.ndarray, ...]
RETRY_STATUSES = frozenset({protocol.OVERLOADED, protocol.UNAVAILABLE})
RESEND_S = 0.005  # how soon a send that found every connected endpoint's queue full is tried again
log = logging.getLogger("inferd.client")


@dataclass(frozen=True)
class RetryPolicy:
    """How a call is retried: at most `max_attempts` tries, backoff doubling from
    `initial_delay` up to `max_delay` seconds, each delay varied by +/- `jitter` of itself."""

    max_attempts: int = 3
    initial_delay: float = 0.1
    max_delay: float = 1.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number `attempt + 1` (attempts count from 1)."""
        doublings = min(attempt - 1, 64)  # far past max_delay already; keeps the float finite
        base = min(self.max_delay, self.initial_delay * 2**doublings)
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


def _as_numpy(value: Array) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        # Imported here, not above: a client whose caller has no torch never loads it, and one
        # handed a tensor has it loaded already.
        from inferd.arrays import to_numpy

        value = to_numpy(value.detach().cpu())
    return protocol.wire_array(np.asarray(value))


def _as_inputs(inputs: Array | Sequence[Array]) -> list[np.ndarray]:
    if isinstance(inputs, (list, tuple)):
        return [_as_numpy(x) for x in inputs]
    return [_as_numpy(inputs)]


@dataclass
class _Retry:
    delay: float


Encode = Callable[[int], list[protocol.Buffer]]  # the time left in ms -> the message of an attempt
Result = Callable[[protocol.ReplyHeader, list[np.ndarray]], Any]  # an `ok` reply -> what the caller gets


def _outputs(header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Outputs:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _Call:
    """One logical request across its attempts: what to send, and what each answer means."""

    def __init__(self, request_id: int, encode: Encode, timeout: float, policy: RetryPolicy,
                 result: Result = _outputs) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.endpoint: Endpoint | None = None  # where the current attempt is in flight
        self.avoid: Endpoint | None = None  # where the last attempt failed: elsewhere first
        self.id = request_id
        self.encode = encode
        self.result = result
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.policy = policy
        self.attempts = 0

    def frames(self) -> list[protocol.Buffer]:
        """The next attempt's message, carrying the time left as its timeout."""
        self.attempts += 1
        return self.encode(max(1, int((self.deadline - time.monotonic()) * 1000)))

    def settle(self, header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Any:
        """The call's result, its error, or a retry after a delay."""
        if header.status == protocol.OK:
            return self.result(header, outputs)
        if header.status in RETRY_STATUSES:
            retry = self._retry()
            if retry is not None:
                return retry
        cls = ERROR_BY_STATUS.get(header.status, InferdError)
        return cls(header.error or header.status, self.id)

    def missed(self) -> InferdError | _Retry:
        """The connection dropped with this call in flight: retry, or give up."""
        return self._retry() or Unavailable("the connection to the daemon dropped before the reply came", self.id)

    def refused(self) -> Unavailable:
        """The daemon refused this client's CURVE key: retrying cannot help."""
        return Unavailable("the daemon refused this client's CURVE key (is its public key in the daemon's "
                           "server.curve_authorized_keys folder?)", self.id)

    def expired(self, unreachable: str | None = None) -> Timeout:
        """The error of a call whose deadline passed with no reply (and why, if no daemon could be reached)."""
        reason = f": no daemon reachable at {unreachable}" if unreachable else ""
        return Timeout(f"no reply within {self.timeout:g} s{reason}", self.id)

    def _retry(self) -> _Retry | None:
        if self.attempts >= self.policy.max_attempts:
            return None
        delay = self.policy.delay(self.attempts)
        # A retry that cannot be answered before the deadline is not worth sending.
        if time.monotonic() + delay >= self.deadline:
            return None
        return _Retry(delay)


FromRegion = Callable[[protocol.TensorMeta], np.ndarray]  # an output written to a region -> a view of it


@dataclass(frozen=True)
class _Cancel:
    """A call whose future was cancelled: the daemon is to be told."""

    call_id: int


def _curve(server_key: KeyFile | None, client_key: KeyFile | None) -> Callable[[zmq.Socket], None]:
    """What to do to each new socket so that it speaks CURVE (nothing, without keys)."""
    if (server_key is None) != (client_key is None):
        raise ValueError("CURVE needs both server_key (the server's public key file) and client_key "
                         "(this client's secret key file)")
    if server_key is None or client_key is None:
        return lambda socket: None
    server_public, pair = curve.load_public(server_key), curve.load_pair(client_key)
    return lambda socket: curve.secure_client(socket, server_public, pair)


class _Mailbox:
    """What other threads hand the I/O thread: calls, DNS answers, and None to stop.

    Once the I/O thread stops it shuts the mailbox before taking what is left, so
    nothing posted later is lost unanswered: the post is refused instead.
    """

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._open = True

    def post(self, item: _Call | _Cancel | tuple[str, list[str]] | None) -> bool:
        """Hand `item` over and wake the I/O thread; False once the mailbox is shut."""
        with self._lock:
            if not self._open:
                return False
            self.items.put(item)
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the I/O thread has a wake-up pending, and takes every item
            return True

    def shut(self) -> None:
        """Refuse every later post."""
        with self._lock:
            self._open = False

    def close(self) -> None:
        """Shut, and close the wake pipe (after the I/O thread has stopped)."""
        with self._lock:
            if self._wake_w != -1:
                self._open = False
                os.close(self.wake_r)
                os.close(self._wake_w)
                self._wake_w = -1


class Client:
    """A thread-safe client; one I/O thread owns the sockets, any thread may call.

    `endpoints` is one endpoint, a list of them, or a tcp:// host name that
    resolves to several addresses (looked up again every `resolve_interval`
    seconds, so daemons that come and go are followed). Requests go to the
    connected endpoint with the fewest requests outstanding; endpoints.py says
    how failing or overloaded daemons are rested and probed.

    For daemons with CURVE on their tcp endpoints, give `server_key` (the
    server's public key file) and `client_key` (this client's secret key file,
    whose public half is in the server's authorized folder). `priority` is the
    level of every call that names none (None: the daemon's queue.default_priority).
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0,
                 priority: int | None = None) -> None:
        self.timeout = timeout
        self.priority = priority
        self.retry = retry or RetryPolicy()
        self._ids = itertools.count(1)
        self._mailbox = _Mailbox()
        self._context = zmq.Context()
        addresses = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self._pool = EndpointPool(self._context, addresses, _curve(server_key, client_key))
        self._resolver = None
        if self._pool.names:
            self._resolver = Resolver(self._pool.names, resolve_interval, self._resolved)
            self._resolver.start()
        self._closed = False
        self._regions: dict[str, SharedMemoryRegion] = {}  # registered, by name; re-registered on reconnect
        self._thread = threading.Thread(target=_IOLoop(self._pool, self._mailbox, self._regions,
                                                       self._from_region, self._ids).run,
                                        name="inferd-client", daemon=True)
        self._thread.start()

    def _resolved(self, name: str, addresses: list[str]) -> None:
        # From the resolver's thread: the I/O thread updates the pool. Once closed, nobody needs it.
        self._mailbox.post((name, addresses))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
              version: str | None = None, out: np.ndarray | Sequence[np.ndarray | None] | None = None,
              priority: int | None = None) -> Outputs:
        """Run `model` on `inputs` (batch dim first; a list for several inputs) and wait for its outputs
        (`out`, `priority`: see `submit`)."""
        return self.submit(model, inputs, timeout=timeout, version=version, out=out, priority=priority).result()

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None, out: np.ndarray | Sequence[np.ndarray | None] | None = None,
               priority: int | None = None) -> concurrent.futures.Future:
        """Send a request and return a future of its outputs; do not change `inputs` until it is done.

        An input that lies in a region registered by this client travels as a reference to it, not as
        bytes; `out` (one array, or one per output, None for those sent back in the reply) asks outputs
        written into views of registered regions, and those views are what the future gives.
        `priority`: its level in the daemon's queue, 0 the most urgent (default: the client's).
        Cancelling the future cancels the request in the daemon.
        """
        call_id = next(self._ids)
        arrays = [self._in_region(array) for array in _as_inputs(inputs)]
        places = self._places(out)
        level = self.priority if priority is None else priority

        def encode(left_ms: int) -> list[protocol.Buffer]:
            return protocol.encode_request(call_id, model, arrays, version, left_ms, places, level)

        future = self._post(_Call(call_id, encode, self.timeout if timeout is None else timeout, self.retry))

        def tell_if_cancelled(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                self._mailbox.post(_Cancel(call_id))

        future.add_done_callback(tell_if_cancelled)
        return future

    def shared_memory(self, byte_size: int, name: str | None = None,
                      prefix: str = CLIENT_PREFIX) -> contextlib.AbstractContextManager[SharedMemoryRegion]:
        """A context manager: a new shared-memory region of `byte_size` bytes, registered with the daemon
        as `name`; on exit it is unregistered, unmapped and unlinked. Fill inputs and read outputs
        through its `array` views."""

        @contextlib.contextmanager
        def region_context() -> Iterator[SharedMemoryRegion]:
            region = SharedMemoryRegion.create(byte_size, name, prefix)
            try:
                self._register(region)
                yield region
            finally:
                if self._regions.pop(region.name, None) is not None and not self._closed:
                    self._region_call(protocol.UnregisterRegion(id=next(self._ids), name=region.name))
                region.close()

        return region_context()

    def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> SharedMemoryRegion:
        """Register `byte_size` bytes from `offset` on of the existing shared memory `key` as region `name`,
        and map it here: its `array` views read and write what the daemon sees."""
        region = SharedMemoryRegion(name, key, byte_size, offset)
        try:
            self._register(region)
        except BaseException:
            region.close()
            raise
        return region

    def unregister_region(self, name: str | None = None) -> None:
        """Unregister region `name` (None: every region of this client) and unmap it here."""
        self._region_call(protocol.UnregisterRegion(id=next(self._ids), name=name))
        for each in [name] if name is not None else list(self._regions):
            region = self._regions.pop(each, None)
            if region is not None:
                region.close()

    def regions(self) -> list[protocol.RegionInfo]:
        """The regions the daemon has registered for this client's connection."""
        return list(self._region_call(protocol.RegionStatus(id=next(self._ids))))

    def _register(self, region: SharedMemoryRegion) -> None:
        if len(self._pool.endpoints) != 1 or self._pool.names:
            raise ValueError("shared memory needs a client of one daemon on this machine (one ipc:// or loopback "
                             "endpoint)")
        if region.name in self._regions:
            raise ValueError(f"this client has a region named {region.name!r} already")
        self._region_call(protocol.RegisterRegion(id=next(self._ids), name=region.name, key=region.key,
                                                  byte_size=region.byte_size, offset=region.offset))
        self._regions[region.name] = region

    def _region_call(self, op: protocol.RegionOp) -> tuple[protocol.RegionInfo, ...]:
        """Send a region message and wait for its answer: never retried (a register is not idempotent)."""
        message: list[protocol.Buffer] = [protocol.encode_op(op)]
        call = _Call(int(op.id), lambda left_ms: message, self.timeout, RetryPolicy(max_attempts=1),
                     lambda header, outputs: header.regions or ())
        return self._post(call).result()

    def _in_region(self, array: np.ndarray) -> np.ndarray | protocol.TensorMeta:
        """`array`, or its place in a registered region if it lies in one."""
        for region in self._regions.values():
            meta = region.describe(array)
            if meta is not None:
                return meta
        return array

    def _places(self, out: np.ndarray | Sequence[np.ndarray | None] | None) -> list[protocol.OutputPlace | None]:
        if out is None:
            return []
        places: list[protocol.OutputPlace | None] = []
        for index, array in enumerate([out] if isinstance(out, np.ndarray) else out):
            if array is None:
                places.append(None)
                continue
            place = next(((r.name, offset) for r in self._regions.values()
                          if (offset := r.locate(array)) is not None), None)
            if place is None:
                raise ValueError(f"out[{index}] does not lie in a region this client registered")
            places.append(protocol.OutputPlace(*place))
        return places

    def _from_region(self, meta: protocol.TensorMeta) -> np.ndarray:
        region = self._regions.get(meta.region or "")
        if region is None:
            raise ValueError(f"the reply places an output in region {meta.region!r}, which this client has not")
        return region.array(meta.dtype, meta.shape, meta.offset)

    def _post(self, call: _Call) -> concurrent.futures.Future:
        if self._closed or not self._mailbox.post(call):
            raise Unavailable("the client is closed")
        return call.future

    def close(self) -> None:
        """Stop the I/O thread; calls still in flight fail with Unavailable."""
        if self._closed:
            return
        self._closed = True
        if self._resolver is not None:
            self._resolver.stop()
        self._mailbox.post(None)
        self._thread.join()
        self._mailbox.close()
        self._context.term()
        for region in self._regions.values():  # the daemon forgets them with the connection
            region.close()
        self._regions.clear()


def _settle(future: concurrent.futures.Future, outcome: Any) -> None:
    """Give a call's future its result or error, unless its caller cancelled it meanwhile."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        if not future.cancelled():
            raise
        # cancelled from another thread meanwhile; the cancel is on its way to the I/O thread


class _IOLoop:
    """The client's I/O thread: sends calls, reads replies and connection events, keeps deadlines."""

    def __init__(self, pool: EndpointPool, mailbox: _Mailbox, regions: dict[str, SharedMemoryRegion],
                 from_region: FromRegion, ids: Iterator[int]) -> None:
        self.pool = pool
        self.mailbox = mailbox
        self.regions = regions
        self.from_region = from_region
        self.ids = ids
        self.wake = mailbox.wake_r
        self.pending: dict[int, _Call] = {}
        self.waiting: dict[int, None] = {}  # calls with no connected endpoint to go to, oldest first
        self.timers: list[tuple[float, int, str]] = []  # (when, call id, "send" | "deadline")
        self.poller = zmq.Poller()
        self.poller.register(self.wake, zmq.POLLIN)
        self.by_socket: dict[zmq.Socket, Endpoint] = {}
        for endpoint in pool.endpoints.values():
            self._watch(endpoint)

    def run(self) -> None:
        """Serve until the client posts None; then fail what is left and close the sockets."""
        try:
            self._serve()
            leftover: InferdError = Unavailable("the client was closed before the reply came")
        except Exception as exc:  # a bug here must not leave callers waiting forever
            leftover = InferdError(f"the client's I/O thread failed: {exc!r}")
            raise
        finally:
            self.mailbox.shut()
            while not self.mailbox.items.empty():
                item = self.mailbox.items.get()
                if isinstance(item, _Call) and not item.future.cancelled():
                    self.pending[item.id] = item
            for call in self.pending.values():
                _settle(call.future, type(leftover)(leftover.message, call.id))
            self.pool.close()

    def _serve(self) -> None:
        running = True
        while running:
            now = time.monotonic()
            wait = (self.timers[0][0] if self.timers else now + 1.0) - now
            for target, _ in self.poller.poll(max(0, int(wait * 1000) + 1)):
                if target == self.wake:
                    running = self._take_posts()
                    continue
                endpoint = self.by_socket.get(target)
                if endpoint is None:  # closed earlier in this round
                    continue
                if target is endpoint.socket:
                    self._read_replies(endpoint)
                else:
                    self._read_events(endpoint)
            self._fire_timers()

    def _watch(self, endpoint: Endpoint) -> None:
        for sock in (endpoint.socket, endpoint.monitor):
            self.by_socket[sock] = endpoint
            self.poller.register(sock, zmq.POLLIN)

    def _forget_if_done(self, endpoint: Endpoint) -> None:
        if endpoint.retired and not endpoint.in_flight:
            for sock in (endpoint.socket, endpoint.monitor):
                self.poller.unregister(sock)
                del self.by_socket[sock]
            self.pool.remove(endpoint)

    def _take_posts(self) -> bool:
        try:
            while os.read(self.wake, 4096):
                pass
        except BlockingIOError:
            pass
        while not self.mailbox.items.empty():
            item = self.mailbox.items.get()
            if item is None:
                return False
            if isinstance(item, tuple):
                added, retired = self.pool.update(*item)
                for endpoint in added:
                    self._watch(endpoint)
                for endpoint in retired:
                    self._forget_if_done(endpoint)
            elif isinstance(item, _Cancel):
                self._cancel(item.call_id)
            elif not item.future.cancelled():  # left pending, not running: a caller may still cancel it
                self.pending[item.id] = item
                heapq.heappush(self.timers, (item.deadline, item.id, "deadline"))
                self._send(item)
        return True

    def _send(self, call: _Call) -> None:
        frames = call.frames()
        connected = self.pool.ranked(call.avoid, time.monotonic())
        for endpoint in connected:
            try:
                # Never block: a blocking send would stop this thread, and every deadline with it.
                endpoint.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its queue is full (the high-water mark), or it just went down
                continue
            endpoint.in_flight.add(call.id)
            call.endpoint = endpoint
            return
        call.attempts -= 1
        if connected:
            heapq.heappush(self.timers, (time.monotonic() + RESEND_S, call.id, "send"))
        elif self.pool.refused_everywhere():
            self._finish(call, call.refused())
        else:
            self.waiting[call.id] = None

    def _finish(self, call: _Call, outcome: Outputs | InferdError | _Retry) -> None:
        if call.endpoint is not None:
            call.endpoint.in_flight.discard(call.id)
            call.avoid, call.endpoint = call.endpoint, None
        self.waiting.pop(call.id, None)
        if isinstance(outcome, _Retry):
            heapq.heappush(self.timers, (time.monotonic() + outcome.delay, call.id, "send"))
            return
        del self.pending[call.id]
        _settle(call.future, outcome)

    def _cancel(self, call_id: int) -> None:
        """A caller cancelled this call's future: tell the daemon that has it, and forget it."""
        call = self.pending.pop(call_id, None)
        if call is None:
            return
        self.waiting.pop(call_id, None)
        endpoint = call.endpoint
        if endpoint is None:  # between attempts: no daemon holds it
            return
        endpoint.in_flight.discard(call_id)
        try:
            endpoint.socket.send(protocol.encode_op(protocol.Cancel(id=call_id)), flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: the daemon computes it, and its reply finds no call
            log.debug("could not send the cancel of call %d to %s", call_id, endpoint.address)
        self._forget_if_done(endpoint)

    def _read_replies(self, endpoint: Endpoint) -> None:
        while endpoint.socket.poll(0):
            try:
                frames = endpoint.socket.recv_multipart(copy=False)
                header, outputs = protocol.decode_reply([frame.buffer for frame in frames], self.from_region)
            except Exception as exc:  # noqa: BLE001 - whatever a reply not of the protocol raises; no call to give it to
                log.warning("dropped a malformed reply from %s: %s", endpoint.address, exc)
                continue
            endpoint.answered(header.status, time.monotonic())
            call = self.pending.get(header.id) if isinstance(header.id, int) else None  # None: its deadline passed
            if call is not None:
                self._finish(call, call.settle(header, outputs))
        self._forget_if_done(endpoint)

    def _read_events(self, endpoint: Endpoint) -> None:
        while endpoint.monitor.poll(0):
            event = parse_monitor_message(endpoint.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                endpoint.connected, endpoint.refused = True, False
                self._register_again(endpoint)
                waiting, self.waiting = self.waiting, {}
                for call_id in waiting:
                    self._send(self.pending[call_id])
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                endpoint.refused = True
                if self.pool.refused_everywhere():
                    for call_id in list(self.waiting):
                        self._finish(self.pending[call_id], self.pending[call_id].refused())
            elif event == zmq.EVENT_DISCONNECTED:
                for call_id in sorted(endpoint.dropped(time.monotonic())):
                    call = self.pending.get(call_id)
                    if call is not None:
                        self._finish(call, call.missed())
                self._forget_if_done(endpoint)
                if endpoint.retired:
                    return  # closed: its monitor is gone

    def _register_again(self, endpoint: Endpoint) -> None:
        """A new connection has none of the regions the last one registered: register them again, before
        any request that names them. The answers are not waited for (no call has their ids)."""
        for region in list(self.regions.values()):
            op = protocol.RegisterRegion(id=next(self.ids), name=region.name, key=region.key,
                                         byte_size=region.byte_size, offset=region.offset)
            try:
                endpoint.socket.send(protocol.encode_op(op), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("could not register region %r again on %s", region.name, endpoint.address)

    def _fire_timers(self) -> None:
        if len(self.timers) > 4 * len(self.pending) + 1024:
            # Answered calls leave their deadline entries behind until due; with long
            # timeouts they would pile up, so sweep them out now and then.
            self.timers = [t for t in self.timers if t[1] in self.pending]
            heapq.heapify(self.timers)
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, call_id, kind = heapq.heappop(self.timers)
            call = self.pending.get(call_id)
            if call is None:
                continue
            if kind == "send":
                if call.endpoint is None and call.id not in self.waiting:
                    self._send(call)
            else:
                unreachable = self.pool.describe() if call.id in self.waiting else None
                endpoint = call.endpoint
                self._finish(call, call.expired(unreachable))
                if endpoint is not None:
                    self._forget_if_done(endpoint)


class AsyncClient:
    """The asyncio client: the engine of Client (one I/O thread), awaited from an event loop.

    Its arguments are those of Client.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0,
                 priority: int | None = None) -> None:
        self._client = Client(endpoints, timeout, retry, server_key, client_key, resolve_interval, priority)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
                    version: str | None = None, out: np.ndarray | Sequence[np.ndarray | None] | None = None,
                    priority: int | None = None) -> Outputs:
        """Run `model` on `inputs` and return its outputs (`out`, `priority`: see Client.submit); a task
        cancelled while it awaits this cancels the request in the daemon."""
        return await self.submit(model, inputs, timeout=timeout, version=version, out=out, priority=priority)

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None, out: np.ndarray | Sequence[np.ndarray | None] | None = None,
               priority: int | None = None) -> asyncio.Future:
        """Send a request and return the future of its outputs; cancelling it cancels the request."""
        return asyncio.wrap_future(self._client.submit(model, inputs, timeout=timeout, version=version, out=out,
                                                       priority=priority))

    @property
    def client(self) -> Client:
        """The Client underneath, for what is set up once and blocks briefly: its shared-memory regions."""
        return self._client

    async def close(self) -> None:
        """Close the client; calls still in flight fail with Unavailable."""
        self._client.close()
