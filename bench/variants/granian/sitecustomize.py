"""The HTTP gateway on Granian instead of uvicorn, for bench.front_ends to measure one against the other:

    pip install granian
    python -m bench.front_ends --protocols http --variant uvicorn=. \
        --variant granian-asgi=.:bench/variants/granian,INFERD_GRANIAN=asgi \
        --variant granian-rsgi=.:bench/variants/granian,INFERD_GRANIAN=rsgi

On a daemon's PYTHONPATH this file is imported by every process at start (Python's sitecustomize) and puts
GranianServer in the place of the gateway's HttpServer. It serves the same RestApp in Granian's embedded server
(its Rust HTTP/1.1 server, on the gateway's asyncio loop): through ASGI, or through RSGI (Granian's own
interface, the body read whole and the answer sent in one call) with the ASGI calls the app makes answered
here. It holds the gateway's body budget, not uvicorn's guards (head deadline, body pace, pipelined 400s):
a measurement of the server's cost, not a front end to serve with.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from granian.constants import HTTPModes, Interfaces
from granian.server.embed import Server

from inferd.config.schema import ServerConfig
from inferd.ipc import addresses
from inferd.oip.budget import MIB, BodyBudget
from inferd.oip.http import server as http_server
from inferd.oip.http.body_guard import BodyGuard


class GranianServer:
    """HttpServer's interface (serve, stop) on Granian's embedded server."""

    def __init__(self, app: Any, server: ServerConfig, budget: BodyBudget, closed: Callable[[str], None]) -> None:
        host, port = addresses.split(server.http)
        self.app = app
        self.budget = budget
        self.max_body_bytes = int(server.max_message_mb * MIB)
        rsgi = os.environ.get("INFERD_GRANIAN") == "rsgi"
        self._server = Server(Rsgi(self) if rsgi else self.asgi, address=host, port=int(port),
                              interface=Interfaces.RSGI if rsgi else Interfaces.ASGINL, http=HTTPModes.http1,
                              websockets=False, log_enabled=False)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The app on one request, with the BodyGuard and connection name it reads from the scope."""
        length = next((int(v) for k, v in scope["headers"] if k == b"content-length"), None)
        guard = scope[http_server.BODY] = BodyGuard(self.budget, length, length is None, self.max_body_bytes)
        scope[http_server.CONNECTION] = str(scope.get("client"))
        try:
            await self.app(scope, receive, send)
        finally:
            guard.release()

    async def serve(self, listening: Callable[[], Awaitable[None]]) -> None:
        serving = asyncio.get_running_loop().create_task(self._server.serve())
        await asyncio.sleep(0)  # its first step binds the socket
        await listening()
        await serving

    def stop(self) -> None:
        self._server.stop()


class Rsgi:
    """An RSGI application answering the ASGI app's calls: one receive of the whole body, one send of it all."""

    def __init__(self, server: GranianServer) -> None:
        self.server = server

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        body = await proto()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()]
        asgi = {"type": "http", "method": scope.method, "path": scope.path, "headers": headers, "client": scope.client}
        given = False
        start: dict[str, Any] = {}

        async def receive() -> dict[str, Any]:
            nonlocal given
            if given:
                return {"type": "http.disconnect"}
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                proto.response_bytes(start["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                       for k, v in start["headers"]], message["body"])

        await self.server.asgi(asgi, receive, send)

    def __rsgi_init__(self, loop: Any) -> None:
        """Granian calls it as a worker starts; nothing to prepare."""

    def __rsgi_del__(self, loop: Any) -> None:
        """Granian calls it as a worker stops; nothing to free."""


if os.environ.get("INFERD_GRANIAN") in ("asgi", "rsgi"):
    http_server.HttpServer = GranianServer  # type: ignore[misc]
