"""Python clients of inferd: `Client` (threads) and `AsyncClient` (asyncio).

Both keep many requests in flight on one DEALER socket and match replies by id.
`timeout` is a call's whole deadline, retries included; each attempt sends the
time left as the header's `timeout_ms`. Retries happen on `overloaded`,
`unavailable` and on a reply missed because the connection dropped, with
exponential backoff and jitter, and never once the deadline cannot be met. A
retry reuses the request id, so whichever reply arrives first wins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import os
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from inferd import protocol
from inferd.errors import ERROR_BY_STATUS, InferdError, Timeout, Unavailable

Array = Any  # a numpy array, or a torch tensor on any device
Outputs = Union[np.ndarray, tuple[np.ndarray, ...]]
RETRY_STATUSES = frozenset({protocol.OVERLOADED, protocol.UNAVAILABLE})
# Connection events: a dropped connection or a refused CURVE key end a call's wait;
# a handshake that succeeds clears the refusal.
MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
RESEND_S = 0.01  # how soon a send that found no connection is tried again
_REFUSED = object()


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
        base = min(self.max_delay, self.initial_delay * 2 ** (attempt - 1))
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


def _as_numpy(value: Array) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
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

    def expired(self) -> Timeout:
        """The error of a call whose deadline passed with no reply."""
        return Timeout(f"no reply within {self.timeout:g} s", self.id)

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


KeyFile = Union[str, "os.PathLike[str]"]


def _connect(socket: zmq.Socket, endpoints: str | Sequence[str], server_key: KeyFile | None,
             client_key: KeyFile | None) -> None:
    socket.linger = 0
    if (server_key is None) != (client_key is None):
        raise ValueError("CURVE needs both server_key (the server's public key file) and client_key "
                         "(this client's secret key file)")
    if server_key is not None:
        socket.curve_serverkey = zmq.auth.load_certificate(server_key)[0]
        public, secret = zmq.auth.load_certificate(client_key)
        if secret is None:
            raise ValueError(f"{client_key} holds no secret key (use the .key_secret file)")
        socket.curve_publickey, socket.curve_secretkey = public, secret
    for endpoint in [endpoints] if isinstance(endpoints, str) else endpoints:
        socket.connect(endpoint)


class Client:
    """A thread-safe client; one I/O thread owns the socket, any thread may call.

    For a daemon with CURVE on its tcp endpoints, give `server_key` (the server's
    public key file) and `client_key` (this client's secret key file, whose
    public half is in the server's authorized folder).
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None) -> None:
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._monitor = self._socket.get_monitor_socket(MONITORED)
        _connect(self._socket, endpoints, server_key, client_key)
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name="inferd-client", daemon=True)
        self._thread.start()

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
        if self._closed:
            raise Unavailable("the client is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        call = _Call(next(self._ids), model, _as_inputs(inputs), version,
                     self.timeout if timeout is None else timeout, self.retry)
        self._outbox.put((call, future))
        os.write(self._wake_w, b"\0")
        return future

    def close(self) -> None:
        """Stop the I/O thread; calls still in flight fail with Unavailable."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"\0")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._context.term()

    def _io_loop(self) -> None:
        pending: dict[int, tuple[_Call, concurrent.futures.Future]] = {}
        timers: list[tuple[float, int, str]] = []  # (when, call id, "send" | "deadline")
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)

        def finish(call_id: int, outcome: Any) -> None:
            call, future = pending.pop(call_id)
            if isinstance(outcome, _Retry):
                pending[call_id] = (call, future)
                heapq.heappush(timers, (time.monotonic() + outcome.delay, call_id, "send"))
            elif isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        refused = False  # the daemon's last handshake refused our CURVE key

        def send(call: _Call) -> None:
            # Never block here: with no connection up, a blocking send would stop
            # this thread, and with it every deadline.
            try:
                self._socket.send_multipart(call.frames(), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                call.attempts -= 1
                if refused:
                    finish(call.id, call.refused())
                else:
                    heapq.heappush(timers, (time.monotonic() + RESEND_S, call.id, "send"))

        while not self._closed:
            now = time.monotonic()
            wait = min((t[0] for t in timers), default=now + 1.0) - now
            for target, _ in poller.poll(max(0, int(wait * 1000) + 1)):
                if target is self._socket:
                    while self._socket.poll(0):
                        header, outputs = _decode(self._socket.recv_multipart(copy=False))
                        if header.id in pending:
                            finish(header.id, pending[header.id][0].settle(header, outputs))
                elif target is self._monitor:
                    while self._monitor.poll(0):
                        event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                        refused = event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            continue
                        for call_id, (call, _) in list(pending.items()):
                            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                                finish(call_id, call.refused())
                            elif call.attempts:
                                finish(call_id, call.missed())
                else:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    while not self._outbox.empty():
                        call, future = self._outbox.get()
                        if future.set_running_or_notify_cancel():
                            pending[call.id] = (call, future)
                            heapq.heappush(timers, (call.deadline, call.id, "deadline"))
                            send(call)
            now = time.monotonic()
            while timers and timers[0][0] <= now:
                _, call_id, kind = heapq.heappop(timers)
                if call_id not in pending:
                    continue
                call = pending[call_id][0]
                if kind == "send":
                    send(call)
                else:
                    finish(call_id, call.expired())
        for call, future in pending.values():
            future.set_exception(Unavailable("the client was closed before the reply came", call.id))
        self._monitor.close()
        self._socket.close()


class AsyncClient:
    """The asyncio client; use it from one event loop. CURVE keys as for Client."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 10.0,
                 retry: RetryPolicy | None = None, server_key: KeyFile | None = None,
                 client_key: KeyFile | None = None) -> None:
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._ids = itertools.count(1)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._monitor = self._socket.get_monitor_socket(MONITORED)
        _connect(self._socket, endpoints, server_key, client_key)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def infer(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
                    version: str | None = None) -> Outputs:
        """Run `model` on `inputs` and return its outputs."""
        call = _Call(next(self._ids), model, _as_inputs(inputs), version,
                     self.timeout if timeout is None else timeout, self.retry)
        self._start_reader()
        loop = asyncio.get_running_loop()
        while True:
            waiter = loop.create_future()
            self._waiting[call.id] = waiter
            try:
                await self._socket.send_multipart(call.frames(), copy=False)
                answer = await asyncio.wait_for(waiter, max(0.0, call.deadline - time.monotonic()))
            except TimeoutError:
                raise call.expired() from None
            finally:
                self._waiting.pop(call.id, None)
            if answer is _REFUSED:
                raise call.refused()
            outcome = call.missed() if answer is None else call.settle(*answer)
            if isinstance(outcome, _Retry):
                await asyncio.sleep(outcome.delay)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                return outcome

    def submit(self, model: str, inputs: Array | Sequence[Array], *, timeout: float | None = None,
               version: str | None = None) -> asyncio.Task:
        """Start a request and return the task that resolves to its outputs."""
        return asyncio.ensure_future(self.infer(model, inputs, timeout=timeout, version=version))

    async def close(self) -> None:
        """Stop reading and close the socket."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self._monitor.close()
        self._socket.close()
        self._context.term()

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            for target, _ in await poller.poll():
                if target is self._socket:
                    header, outputs = _decode(await self._socket.recv_multipart(copy=False))
                    waiter = self._waiting.get(header.id)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((header, outputs))
                else:
                    event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
                    outcome = _REFUSED if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else None
                    for waiter in self._waiting.values():
                        if not waiter.done():
                            waiter.set_result(outcome)
