"""Clients that try to take a gateway's memory, and the measure of what they took: HTTP bodies and gRPC
messages that stop part way, and a process's resident memory sampled while they run.

bench/gateway_memory.py measures with them; tests/test_oip_memory.py holds the gateways to their bounds
with them.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from types import TracebackType

import psutil

GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"


def gateway_pid(supervisor: int, protocol: str) -> int:
    """The pid of the supervisor's (first) gateway process for `protocol` ("http" or "grpc")."""
    for child in psutil.Process(supervisor).children(recursive=True):
        if " ".join(child.cmdline()).startswith(f"inferd: gateway {protocol}"):
            return child.pid
    raise LookupError(f"the daemon {supervisor} has no {protocol} gateway")


class PeakMemory:
    """A process's resident memory, sampled every `every` seconds while the block runs: `before`, `peak`
    and `after` (bytes), and `growth` (peak - before)."""

    def __init__(self, pid: int, every: float = 0.005) -> None:
        self._process = psutil.Process(pid)
        self._every = every
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self.before = self.peak = self.after = 0

    def rss(self) -> int:
        """The process's resident memory now."""
        return int(self._process.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        self.before = self.peak = self.rss()
        self._sampler.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._sampler.join()
        self.after = self.rss()
        self.peak = max(self.peak, self.after)

    @property
    def growth(self) -> int:
        """How far the peak rose above where the block began."""
        return self.peak - self.before

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self.rss())


def answered(connection: socket.socket, within: float) -> bytes:
    """What the server has sent on `connection` within `within` seconds, up to its close (b"" if nothing)."""
    connection.settimeout(within)
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except (TimeoutError, ConnectionError):
        pass
    return received


def start_http_body(address: str, declared: int, sent: int, path: str = "/v2/models/sum/infer") -> socket.socket:
    """A connection that has sent a request head declaring a body of `declared` bytes, and the first `sent`
    of them (fewer if the server refused it and closed first). The caller goes on, or does not."""
    host, _, port = address.rpartition(":")
    connection = socket.create_connection((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()
    try:
        connection.sendall(head)
        chunk = b"0" * (1 << 20)
        for start in range(0, sent, len(chunk)):
            connection.sendall(chunk[:min(len(chunk), sent - start)])
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before it was read: its answer waits on the connection
    return connection


class PartialGrpcCall:
    """A gRPC ModelInfer call over its own HTTP/2 connection that declares a message of `declared` bytes and
    sends the first `sent` of them as fast as the server's flow control lets it (in a thread), then nothing.

    No gRPC library sends part of a message; h2 writes the frames. `sent_bytes` is what went; `status` the
    grpc-status the server ended the call with (None while it has not)."""

    def __init__(self, address: str, declared: int, sent: int) -> None:
        import h2.config
        import h2.connection

        host, _, port = address.rpartition(":")
        self._socket = socket.create_connection((host, int(port)))
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._h2.initiate_connection()
        self._stream = self._h2.get_next_available_stream_id()
        self._h2.send_headers(self._stream, [(":method", "POST"), (":scheme", "http"), (":path", GRPC_PATH),
                                             (":authority", address), ("content-type", "application/grpc"),
                                             ("te", "trailers")])
        self._socket.sendall(self._h2.data_to_send())
        self._pending = (b"\0" + declared.to_bytes(4, "big") + b"\0" * sent)
        self.sent_bytes = 0
        self.status: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import h2.events

        view = memoryview(self._pending)
        while not self._closed.is_set():
            window = min(self._h2.local_flow_control_window(self._stream), self._h2.max_outbound_frame_size) \
                if self.status is None else 0
            if window and self.sent_bytes < len(view):
                piece = view[self.sent_bytes:self.sent_bytes + window]
                self._h2.send_data(self._stream, piece.tobytes())
                self.sent_bytes += len(piece)
                if not self._send():
                    return
                continue
            try:
                if not select.select([self._socket], [], [], 0.05)[0]:
                    continue
                data = self._socket.recv(65536)
            except OSError:
                return
            if not data:
                self.status = self.status or "closed"
                return
            for event in self._h2.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = dict(event.headers).get("grpc-status")
                    self.status = status or self.status
                elif isinstance(event, h2.events.StreamReset):
                    self.status = self.status or f"reset {event.error_code}"
            if not self._send():
                return

    def _send(self) -> bool:
        """Send what h2 has to; False once the connection is gone."""
        try:
            self._socket.sendall(self._h2.data_to_send())
        except OSError:
            return False
        return True

    def wait_sent(self, timeout: float, stalled_after: float = 1.0) -> int:
        """Wait until everything is sent, the call ended, or nothing more went for `stalled_after` seconds
        (the server does not read it); at most `timeout`. Returns the bytes sent."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline and self.status is None and self.sent_bytes < len(self._pending):
            if self.sent_bytes != last:
                last, since = self.sent_bytes, time.monotonic()
            elif time.monotonic() - since >= stalled_after:
                break
            time.sleep(0.02)
        return self.sent_bytes

    def close(self) -> None:
        """Drop the connection."""
        self._closed.set()
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # a send blocked on a server that does not read ends
        except OSError:
            pass
        self._thread.join()
        self._socket.close()
