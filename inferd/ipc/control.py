"""The control socket's messages, and the client `inferctl` talks through.

A command is a JSON frame `{"command": NAME, "args": {...}}`; its answer is a
JSON frame `{"ok": true, "result": ...}` or `{"ok": false, "error": SENTENCE}`.
`infer` is the exception: a wire-format request follows the command frame and
a wire-format reply comes back, so the control path and the data path share
one decoder and one validator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import zmq

from inferd.protocol import Buffer


class Command(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One control command."""

    command: str
    args: dict[str, Any] = {}


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer to one control command."""

    ok: bool
    result: Any = None
    error: Union[str, None] = None


_encoder = msgspec.json.Encoder()
_command_decoder = msgspec.json.Decoder(Command)
_answer_decoder = msgspec.json.Decoder(Answer)


def encode_command(command: str, **args: Any) -> bytes:
    """The frame of a command."""
    return _encoder.encode(Command(command, args))


def decode_command(frame: Buffer) -> Command:
    """A command frame; raises msgspec errors on a malformed one."""
    return _command_decoder.decode(frame)


def encode_answer(answer: Answer) -> bytes:
    """The frame of an answer."""
    return _encoder.encode(answer)


class ControlError(Exception):
    """The daemon cannot be reached, or refused the command; the message is one sentence."""


class ControlClient:
    """A connection to a daemon's control socket."""

    def __init__(self, endpoint: str, timeout: float | None = 5.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):]):
            raise ControlError(f"no daemon is listening at {endpoint} (the socket does not exist)")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        self._socket.connect(endpoint)

    def close(self) -> None:
        """Close the connection."""
        self._socket.close()
        self._context.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exchange(self, frames: Sequence[Buffer], timeout: float | None = None) -> list[zmq.Frame]:
        """Send one multipart message, wait for its answer; raise ControlError when none comes."""
        timeout = self.timeout if timeout is None else timeout
        self._socket.send_multipart(frames, copy=False)
        if not self._socket.poll(None if timeout is None else int(timeout * 1000)):
            raise ControlError(f"the daemon at {self.endpoint} did not answer within {timeout:g} s")
        return self._socket.recv_multipart(copy=False)

    def call(self, command: str, timeout: float | None = None, **args: Any) -> Any:
        """Run a command and return its result; raise ControlError with the daemon's sentence."""
        reply = self.exchange([encode_command(command, **args)], timeout)
        answer = _answer_decoder.decode(reply[0].buffer)
        if not answer.ok:
            raise ControlError(answer.error or f"{command} failed")
        return answer.result
