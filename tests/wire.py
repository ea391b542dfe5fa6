"""A raw ZeroMQ peer for tests that look at the wire itself, below the Client."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from inferd import protocol


class RawPeer:
    """A DEALER (or REQ) socket that sends hand-made messages and reads raw replies."""

    def __init__(self, endpoint: str, kind: int = zmq.DEALER) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(kind)
        self.socket.linger = 0
        self.socket.connect(endpoint)

    def close(self) -> None:
        """Close the socket and its context."""
        self.socket.close()
        self.context.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_frames(self, frames: Sequence[Any]) -> None:
        """Send one multipart message exactly as given (a DEALER adds no delimiter)."""
        self.socket.send_multipart(list(frames))

    def send(self, request_id: Any, model: str, arrays: Sequence[np.ndarray], **header: Any) -> None:
        """Send a well-formed request; extra header fields override or add to it."""
        body = {
            "id": request_id,
            "model": model,
            "inputs": [{"dtype": protocol.wire_dtype(a), "shape": list(a.shape)} for a in arrays],
            **header,
        }
        self.send_frames([msgspec.json.encode(body), *(protocol.pack_bytes(a.flat) if a.dtype == object
                                                       else np.ascontiguousarray(a).tobytes() for a in arrays)])

    def recv(self, timeout: float = 20.0) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The next reply: its header as a dict, and the outputs it carries as arrays.

        The empty delimiter a REQ-style message starts with comes back first; it is skipped.
        """
        if not self.socket.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply within {timeout} s")
        frames = self.socket.recv_multipart()
        if frames[0] == b"" and len(frames) > 1:
            frames = frames[1:]
        header = msgspec.json.decode(frames[0])
        outputs = [  # an output written into a client's region has no frame
            protocol.bytes_array(frame, meta["shape"]) if meta["dtype"] == protocol.BYTES
            else np.frombuffer(frame, dtype=protocol.DTYPES[meta["dtype"]]).reshape(meta["shape"])
            for meta, frame in zip([m for m in header.get("outputs", []) if m.get("region") is None], frames[1:])
        ]
        return header, outputs

    def barrier(self) -> list[tuple[dict[str, Any], list[np.ndarray]]]:
        """Send a request the daemon refuses at once (for a model it does not serve) and read up to its reply,
        so that what this peer sent before has been handled: the daemon reads one connection in order. The
        replies that came before it."""
        self.send("barrier", "no model by this name", [np.zeros((1, 1), dtype=np.float32)])
        before = []
        while (reply := self.recv())[0]["id"] != "barrier":
            before.append(reply)
        return before

    def nothing_more(self, wait: float = 0.3) -> bool:
        """True when no further message arrives within `wait` seconds."""
        return not self.socket.poll(int(wait * 1000))


class ScriptedServer:
    """A ROUTER that answers each request (of a group too: each alone) with what `answer(attempt, header,
    buffers)` returns."""

    def __init__(self, answer: Callable[[int, dict, list[bytes]], list[bytes] | None]) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.linger = 0
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.answer = answer
        self.headers: list[dict] = []
        self.group_sizes: list[int] = []  # how many requests each message carried
        self.reading = threading.Event()  # clear it to stop reading requests for a while
        self.reading.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.reading.wait(0.02) or not self.socket.poll(20):
                continue
            identity, *body = self.socket.recv_multipart()
            members = protocol.group_of(body, 1 << 40) or [body]
            self.group_sizes.append(len(members))
            for header, *buffers in members:
                decoded = msgspec.json.decode(header)
                self.headers.append(decoded)
                reply = self.answer(len(self.headers), decoded, buffers)
                if reply is not None:
                    self.socket.send_multipart([identity, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()
        self.context.term()


def ok(header: dict, *outputs: np.ndarray) -> list[bytes]:
    reply = protocol.ReplyHeader(
        id=header["id"], status="ok", model=header["model"], version="v1",
        outputs=tuple(protocol.TensorMeta(o.dtype.name, o.shape) for o in outputs),
        timing_us=protocol.Timing(1, 1, 2),
    )
    return [protocol.encode_reply(reply), *(o.tobytes() for o in outputs)]


def error(header: dict, status: str, message: str = "no") -> list[bytes]:
    return [protocol.error_reply(header["id"], status, message)]
