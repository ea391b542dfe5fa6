"""Python clients of inferd: `Client` (threads) and `AsyncClient` (asyncio).

A client keeps many requests in flight and matches replies by id. It takes one
endpoint, several, or a host name that resolves to several (endpoints.py
spreads the requests and tracks each daemon's health). `timeout` is a call's
whole deadline, retries included; each attempt sends the time left as the
header's `timeout_ms`. Retries happen on `overloaded`, `unavailable` and on a
reply lost because a connection dropped, with exponential backoff and jitter,
on another endpoint where there is one, and never once the deadline cannot be
met. A retry reuses the request id, so whichever reply arrives first wins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd import curve, protocol
from inferd.curve import KeyFile
from inferd.endpoints import Endpoint, EndpointPool, Resolver
from inferd.errors import ERROR_BY_STATUS, InferdError, Timeout, Unavailable

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


class _Call:
    """One logical request across its attempts: what to send, and what each answer means."""

    def __init__(self, request_id: int, model: str, arrays: list[np.ndarray], version: str | None,
                 timeout: float, policy: RetryPolicy) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.endpoint: Endpoint | None = None  # where the current attempt is in flight
        self.avoid: Endpoint | None = None  # where the last attempt failed: elsewhere first
        self.id = request_id
        self.model = model
        self.arrays = arrays
        self.version = version
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.policy = policy
        self.attempts = 0

    def frames(self) -> list[protocol.Buffer]:
        """The next attempt's message, carrying the time left as its timeout."""
        self.attempts += 1
        left_ms = max(1, int((self.deadline - time.monotonic()) * 1000))
        return protocol.encode_request(self.id, self.model, self.arrays, self.version, left_ms)

    def settle(self, header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Outputs | InferdError | _Retry:
        """The call's result, its error, or a retry after a delay."""
        if header.status == protocol.OK:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
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


def _decode(frames: list[zmq.Frame]) -> tuple[protocol.ReplyHeader, list[np.ndarray]]:
    return protocol.decode_reply([frame.buffer for frame in frames])


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

    def post(self, item: _Call | tuple[str, list[str]] | None) -> bool:
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
    whose public half is in the server's authorized folder).
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0) -> None:
        self.timeout = timeout
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
        self._thread = threading.Thread(target=_IOLoop(self._pool, self._mailbox).run,
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
              version: str | None = None) -> Outputs:
        """Run `model` on `inputs` (batch dim first; a list for several inputs) and wait for its outputs."""
        return self.submit(model, inputs, timeout=timeout, version=version).result()

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None) -> concurrent.futures.Future:
        """Send a request and return a future of its outputs; do not change `inputs` until it is done."""
        call = _Call(next(self._ids), model, _as_inputs(inputs), version,
                     self.timeout if timeout is None else timeout, self.retry)
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


class _IOLoop:
    """The client's I/O thread: sends calls, reads replies and connection events, keeps deadlines."""

    def __init__(self, pool: EndpointPool, mailbox: _Mailbox) -> None:
        self.pool = pool
        self.mailbox = mailbox
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
                if isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                    self.pending[item.id] = item
            for call in self.pending.values():
                call.future.set_exception(type(leftover)(leftover.message, call.id))
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
            elif item.future.set_running_or_notify_cancel():
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
        if isinstance(outcome, BaseException):
            call.future.set_exception(outcome)
        else:
            call.future.set_result(outcome)

    def _read_replies(self, endpoint: Endpoint) -> None:
        while endpoint.socket.poll(0):
            try:
                header, outputs = _decode(endpoint.socket.recv_multipart(copy=False))
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
                 client_key: KeyFile | None = None, resolve_interval: float = 30.0) -> None:
        self._client = Client(endpoints, timeout, retry, server_key, client_key, resolve_interval)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
                    version: str | None = None) -> Outputs:
        """Run `model` on `inputs` and return its outputs."""
        return await self.submit(model, inputs, timeout=timeout, version=version)

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None) -> asyncio.Future:
        """Send a request and return the future of its outputs."""
        return asyncio.wrap_future(self._client.submit(model, inputs, timeout=timeout, version=version))

    async def close(self) -> None:
        """Close the client; calls still in flight fail with Unavailable."""
        self._client.close()
