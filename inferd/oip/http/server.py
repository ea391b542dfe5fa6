"""The gateway's HTTP server: uvicorn with httptools, guarded against clients that hold a connection
without finishing a request, or send more header than any request of the protocol needs.

uvicorn closes a connection that idles between requests (keep-alive), but not one that never
finishes its request head or body, and it keeps every header it is sent. The guard adds a deadline
for each request head, bounds on its headers and target, and a BodyGuard on its body (body_guard.py:
a share of the process's buffer, and a pace), so a slow-loris client costs one socket for at most
HEAD_TIMEOUT_S, or body_guard.PACE_WINDOW_S once its body comes slower than server.min_body_kib_s.

It also tells a request whose answer is awaited that its connection ended (Watch, in its scope), so
the request can be taken out of the daemon's queue: nobody is left to read its answer; and it sends
a response's head and body in one write (CorkedWrites).

Where uvicorn answers a malformed request 400 at once, the guard first lets the requests pipelined
before it be answered, in order (a client reads the first answer as its first request's), then
answers 400 and closes. A request framed by both Content-Length and Transfer-Encoding: chunked
(`requests` sends one when its caller chunked the body) is read by its chunks and its connection
closed after its answer, as RFC 9112 section 6.3 allows and requires; llhttp refuses it otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from inferd.config.schema import ServerConfig, client_shm_protocols
from inferd.ipc import addresses
from inferd.oip.budget import MIB, BodyBudget
from inferd.oip.http.body_guard import BodyGuard
from inferd.oip.shm import peer_name

log = logging.getLogger("inferd.oip.http")

KEEP_ALIVE_S = 5  # an idle connection is closed after this long
# ... unless its client may register shared memory: its regions go with its connection, so it is kept
# as long as gRPC keeps one.
SHM_KEEP_ALIVE_S = 60
HEAD_TIMEOUT_S = 10.0  # from a connection's first byte, or a request's, until its headers are complete
MAX_HEADERS = 100
MAX_HEAD_BYTES = 64 << 10  # request line and headers together


CORK_BYTES = 64 << 10  # a write this large goes out at once, not joined (and so copied) with the rest
READ_BYTES = 256 << 10  # the most a connection's read takes at once, as asyncio's own reads
# Every connection of the process reads into this buffer: what a read brings is copied out of it at once.
_read_buffer = memoryview(bytearray(READ_BYTES))
CONNECTION = "inferd.connection"  # the scope's key for the name of the connection a request came on
WATCH = "inferd.watch"  # the scope's key for the connection's Watch
BODY = "inferd.body"  # the scope's key for the request's BodyGuard
_numbers = itertools.count(1)


class Watch:
    """What runs when a connection ends: the callbacks of the requests on it that await their answers."""

    __slots__ = ("_callbacks", "_read_on", "lost")

    def __init__(self, read_on: Callable[[], None]) -> None:
        self.lost = False
        self._callbacks: set[Callable[[], object]] = set()
        self._read_on = read_on

    def add(self, callback: Callable[[], object]) -> bool:
        """Call `callback` once, should the connection end before discard(callback); False (and it is not
        added) when it has ended already."""
        if self.lost:
            return False
        # A client's close is seen only while the connection is read (uvicorn pauses reading behind a
        # large body); what a client sends meanwhile is a pipelined request, which uvicorn bounds.
        self._read_on()
        self._callbacks.add(callback)
        return True

    def discard(self, callback: Callable[[], object]) -> None:
        """No longer call `callback`."""
        self._callbacks.discard(callback)

    def end(self) -> None:
        """The connection has ended: run and forget every callback."""
        self.lost = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()


class CorkedWrites:
    """A connection's transport as uvicorn writes to it, with what it writes in one turn of the loop
    sent at the turn's end in one write. uvicorn writes a response's head and its body apart, and
    each write is a send(): the second one was a fifth of the gateway's CPU per request. A large
    write is not held (joining would copy it): what is held goes first, then it."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Send `data` after what is held, at the end of this turn of the loop (a large one now)."""
        if len(data) >= CORK_BYTES:
            self.flush()
            self._transport.write(data)
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        """Send what is held, unless the connection is closing."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        """Send what is held, then close."""
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol, asyncio.BufferedProtocol):
    """uvicorn's httptools protocol with a deadline on each request head and bounds on its size; a
    BodyGuard on each request's body (its share of the gateway's buffer, and its pace); it names each
    connection (the client's address and a number, in each request's scope) and reports its end to
    `closed`.

    It reads into a buffer of its own (a BufferedProtocol): asyncio reads a plain Protocol's data into a new
    256 KiB bytes object, which the allocator maps, shrinks and unmaps, three system calls a read (this
    server alone, answering a fixed body at 64 requests in flight, spent 115 us of CPU a request that way and
    78 us with its own buffer)."""

    closed: Callable[[str], None] = staticmethod(lambda name: None)
    budget = BodyBudget(0)  # the process's, set with the server's config (HttpServer)
    max_body_bytes = 0
    min_body_bytes_s = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)  # checked in _chunked_with_length
        self._held_400: str | None = None  # a 400 waiting for the answers to the requests before it
        self._before: RequestResponseCycle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._refusal: str | None = None
        self._name = ""
        self._watch: Watch | None = None
        self._guards: set[BodyGuard] = set()  # of this connection's requests not yet answered
        self._arriving: BodyGuard | None = None  # of the request whose body is being parsed
        self._pace: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CorkedWrites(transport, self.loop)  # type: ignore[assignment]
        host, port = self.client or ("", 0)
        self._name = f"{peer_name(host, port)}/{next(_numbers)}"
        self._watch = Watch(self.flow.resume_reading)
        self._set_timer(HEAD_TIMEOUT_S, "no complete request head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_timer(None)
        self._body_ended()
        for guard in self._guards:
            guard.release()
        self._guards.clear()
        super().connection_lost(exc)
        if self._watch is not None:
            self._watch.end()
        self.closed(self._name)

    def on_message_begin(self) -> None:
        self._before = self.cycle  # the latest request before this one, should this one's body fail to parse
        super().on_message_begin()
        self.scope[CONNECTION] = self._name  # type: ignore[literal-required] # an extension of this server
        self.scope[WATCH] = self._watch  # type: ignore[literal-required]
        self._head_bytes = 0
        if self._timer is None:
            self._set_timer(HEAD_TIMEOUT_S, "no complete request head")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        if len(self.headers) >= MAX_HEADERS:
            self._refuse(f"more than {MAX_HEADERS} headers")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        chunked_with_length = self._chunked_with_length()
        self._set_timer(None)
        length = next((value for name, value in self.headers if name == b"content-length"), b"")
        chunked = any(name == b"transfer-encoding" for name, _ in self.headers)  # else llhttp refused it
        guard = BodyGuard(self.budget, int(length) if length.isdigit() else None, chunked, self.max_body_bytes)
        self.scope[BODY] = guard  # type: ignore[literal-required]
        super().on_headers_complete()
        if chunked_with_length:
            self.cycle.keep_alive = False
        self._guards.add(guard)
        answered = self.cycle.on_response

        def on_response() -> None:
            guard.release()
            self._guards.discard(guard)
            answered()

        self.cycle.on_response = on_response
        if guard.refusal is None and (chunked or guard.expected):
            self._arriving = guard  # paced once a read ends with its body unfinished (data_received)

    def on_body(self, body: bytes) -> None:
        guard = self._arriving
        if guard is not None and not guard.arrived(len(body)):
            # Refused (or cut): the app answers it, and these bytes are never kept.
            self.cycle.message_event.set()
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_ended()
        super().on_message_complete()

    def _body_ended(self) -> None:
        self._arriving = None
        if self._pace is not None:
            self._pace.cancel()
            self._pace = None

    def _pace_tick(self) -> None:
        """Each second while a body arrives: cut it if it comes too slowly (BodyGuard.tick)."""
        guard = self._arriving
        if guard is None:
            return
        refusal = guard.tick(self.min_body_bytes_s, self.flow.read_paused)
        if refusal is None:
            self._pace = self.loop.call_later(1, self._pace_tick)
            return
        self._pace = None
        log.warning("cutting a request body from %s: %s", self.client, refusal.message)
        if self.cycle.response_complete:  # answered already, without its body: nobody is left to tell
            self.transport.close()
        else:
            self.cycle.message_event.set()  # the app, reading the body, answers the refusal

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(f"a request head of over {MAX_HEAD_BYTES} bytes")

    def _refuse(self, what: str) -> None:
        # Raised inside a parser callback, this ends the parse; uvicorn then answers 400 and closes.
        log.warning("refusing a request from %s: %s", self.client, what)
        self._refusal = f"The request was refused: {what}."
        raise ValueError(what)

    def _chunked_with_length(self) -> bool:
        """Whether the request has both Content-Length and Transfer-Encoding, chunked last (RFC 9112
        section 6.3): its body is its chunks, so its Content-Length goes, and its connection closes after
        its answer (a proxy before it may have read another request's start into it). With any other
        Transfer-Encoding as well as Content-Length, it is refused."""
        codings = [value for name, value in self.headers if name == b"transfer-encoding"]
        if not codings or all(name != b"content-length" for name, _ in self.headers):
            return False
        if b",".join(codings).rsplit(b",", 1)[-1].strip().lower() != b"chunked":
            self._refuse("Content-Length with a Transfer-Encoding that does not end in chunked")
        self.headers[:] = [(name, value) for name, value in self.headers if name != b"content-length"]
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        return _read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_read_buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self._held_400 is None:  # past a malformed request, nothing more is read
            super().data_received(data)
        if self._arriving is not None and self._pace is None:
            self._pace = self.loop.call_later(1, self._pace_tick)

    def send_400_response(self, msg: str) -> None:
        """Answer a malformed request 400 and close, once the requests before it are answered."""
        self._body_ended()  # nothing more is read
        failed = self.cycle if self.cycle is not None and self.cycle.scope is self.scope else None
        if failed is not None:  # its head was read, its body is what failed: the 400 answers it, unrun
            if failed.response_complete:  # answered before its body was read: that was its one answer
                self.transport.close()
                return
            failed.disconnected = True
            failed.message_event.set()
            if self.pipeline and self.pipeline[0][0] is failed:
                self.pipeline.popleft()
            self.cycle = self._before  # type: ignore[assignment] # as if it had never begun
        self._held_400 = self._refusal or msg
        self._set_timer(None)
        self._answer_400_in_turn()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._answer_400_in_turn()

    def _answer_400_in_turn(self) -> None:
        """Send the held 400 unless a request before it still awaits its answer: one queued (pipelined),
        or the latest one, which runs when none is queued (or unless the connection is closing)."""
        if self._held_400 is None or self.pipeline or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete and not self.cycle.disconnected:
            return
        super().send_400_response(self._held_400)

    def _set_timer(self, seconds: float | None, what: str = "") -> None:
        """Close the connection in `seconds` unless the next step of the request comes first (None: none)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if seconds is None else self.loop.call_later(seconds, self._timed_out, seconds, what)

    def _timed_out(self, seconds: float, what: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.warning("closing a connection from %s: %s within %g s", self.client, what, seconds)
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, with the gateway's own signal handling (uvicorn's would take SIGINT too), that
    calls `listening` once its socket takes connections."""

    listening: Callable[[], Awaitable[None]] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.listening is not None:
            await self.listening()


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to HOST:PORT that other processes may bind too (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class HttpServer:
    """The Open Inference Protocol's HTTP front end: serves `app` at server.http until stopped."""

    def __init__(self, app: Any, server: ServerConfig, budget: BodyBudget, closed: Callable[[str], None]) -> None:
        """`budget`: what the process's unfinished requests may hold; `closed(name)`: the connection `name`
        (CONNECTION in its requests' scopes) has ended."""
        host, port = addresses.split(server.http)
        # With several HTTP gateway processes, each listens on the port with SO_REUSEPORT, and the kernel
        # spreads new connections over them; with one, uvicorn binds it, and a port held is an error.
        self._sockets = [_reuse_port_socket(host, int(port))] if server.http_processes > 1 else None
        protocol = type("ServerProtocol", (GuardedProtocol,), {
            "closed": staticmethod(closed), "budget": budget,
            "max_body_bytes": int(server.max_message_mb * MIB), "min_body_bytes_s": int(server.min_body_kib_s * 1024),
        })
        self._server = _Server(uvicorn.Config(
            app, host=host, port=int(port), lifespan="off", log_level="error", access_log=False,
            proxy_headers=False,
            http=protocol, loop="none",
            timeout_keep_alive=SHM_KEEP_ALIVE_S if "http" in client_shm_protocols(server) else KEEP_ALIVE_S,
            ssl_certfile=server.tls_cert or None, ssl_keyfile=server.tls_key or None,
        ))

    async def serve(self, listening: Callable[[], Awaitable[None]]) -> None:
        """Serve until stop(), calling `listening` once connections are taken; requests in progress are
        answered first."""
        self._server.listening = listening
        await self._server.serve(sockets=self._sockets)

    def stop(self) -> None:
        """Stop taking connections and return from serve() once what is in progress is answered."""
        self._server.should_exit = True
