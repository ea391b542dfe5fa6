"""The HTTP server Prometheus scrapes, in the supervisor's process: bounded, so that whoever reaches its port
cannot take the supervisor's descriptors or threads.

prometheus-client's own server gives each connection a thread and a descriptor for as long as the client
keeps it open, with no bound: a few hundred idle connections took every descriptor the supervisor had left,
and the next connection to its ipc:// control socket aborted it (libzmq 4.3.5 cannot refuse one for want of
a descriptor). Here at most MAX_CONNECTIONS are served at once, the rest closed as soon as they are accepted
(Prometheus tries again at its next scrape), and each is closed TIMEOUT_S after it was accepted, however
slowly it trickles. A scrape is one short request, and Prometheus scrapes with one connection per target.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("inferd.metrics")

MAX_CONNECTIONS = 16
TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    timeout = TIMEOUT_S  # on each read and write; the server's sweep bounds the whole connection

    def log_message(self, format: str, *args: Any) -> None:
        """A scrape is not an event worth a line."""


class MetricsHttpServer(ThreadingMixIn, WSGIServer):
    """A thread for each connection, at most MAX_CONNECTIONS at once."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 leaves a burst of scrapers waiting on SYN retries

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # each connection served -> when it is closed
        super().__init__((host, port), _Handler)
        self.set_app(make_wsgi_app(registry))

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in a thread of its own, or close it at once when MAX_CONNECTIONS are served."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + TIMEOUT_S
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot is not taken after all
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve, then give the slot back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def service_actions(self) -> None:
        """Between accepts (every half second at the most): shut the connections past their deadline; their
        threads then end."""
        now = time.monotonic()
        with self._lock:
            late = [request for request, deadline in self._deadlines.items() if deadline <= now]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed by its thread meanwhile

    def _release(self, request: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for a connection that failed (socketserver prints a traceback): at most MAX_CONNECTIONS
        each TIMEOUT_S."""
        log.debug("metrics: the connection from %s ended: %s", client_address[0], sys.exception())

    def start(self) -> threading.Thread:
        """Serve from a thread of its own; returns it."""
        thread = threading.Thread(target=self.serve_forever, name="inferd-metrics", daemon=True)
        thread.start()
        return thread
