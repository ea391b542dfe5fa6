"""A raw ZeroMQ peer for tests that look at the wire itself, below the Client."""

from __future__ import annotations

from collections.abc import Sequence
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
            "inputs": [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays],
            **header,
        }
        self.send_frames([msgspec.json.encode(body), *(np.ascontiguousarray(a).tobytes() for a in arrays)])

    def recv(self, timeout: float = 20.0) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The next reply: its header as a dict, and its outputs as arrays.

        The empty delimiter a REQ-style message starts with comes back first; it is skipped.
        """
        if not self.socket.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply within {timeout} s")
        frames = self.socket.recv_multipart()
        if frames[0] == b"" and len(frames) > 1:
            frames = frames[1:]
        header = msgspec.json.decode(frames[0])
        outputs = [
            np.frombuffer(frame, dtype=protocol.DTYPES[meta["dtype"]]).reshape(meta["shape"])
            for meta, frame in zip(header.get("outputs", []), frames[1:])
        ]
        return header, outputs

    def nothing_more(self, wait: float = 0.3) -> bool:
        """True when no further message arrives within `wait` seconds."""
        return not self.socket.poll(int(wait * 1000))
