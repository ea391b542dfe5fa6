"""The control socket's messages, how a command's answer is read, and the client `inferctl` talks through.

A command is a JSON frame `{"command": NAME, "args": {...}}`; its answer is a
JSON frame `{"ok": true, "result": ...}` or `{"ok": false, "error": SENTENCE}`.
`infer` is the exception: a wire-format request follows the command frame and
a wire-format reply comes back, so the control path and the data path share
one decoder and one validator.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd.ipc.curve import secure_client
from inferd.protocol import Buffer


class Command(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One control command."""

    command: str
    args: dict[str, Any] = {}


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer to one control command, or (with `progress`) a step towards it."""

    ok: bool
    result: Any = None
    error: str | None = None
    progress: str | None = None
    wait_s: float | None = None  # with progress: the final answer comes within this many seconds


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


def decode_answer(frame: Buffer) -> Answer:
    """An answer frame; raises msgspec errors on a malformed one."""
    return _answer_decoder.decode(frame)


class ControlError(Exception):
    """The daemon cannot be reached, or refused the command; the message is one sentence."""


def answer_result(command: str, answer: Answer, error: type[Exception] = ControlError) -> Any:
    """The result of `command`'s final answer; raises `error` with the daemon's sentence when it failed."""
    if not answer.ok:
        raise error(answer.error or f"{command} failed")
    return answer.result


class NoAnswer(ControlError):
    """The daemon did not answer in time (it may be hung, or gone)."""


class NoDaemon(ControlError):
    """No daemon's control socket is at the endpoint."""


FINISH_GRACE_S = 5.0  # beyond the end a daemon announced (`wait_s`), what its last answer may take


class ControlClient:
    """A connection to a daemon's control socket."""

    def __init__(self, endpoint: str, timeout: float | None = 5.0,
                 curve: tuple[bytes, tuple[bytes, bytes]] | None = None) -> None:
        """Connect to `endpoint`; `curve`: the daemon's public key and this client's (public, secret) pair, for
        a tcp:// control socket (which speaks CURVE only)."""
        self.endpoint = endpoint
        self.timeout = timeout
        if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):]):
            raise NoDaemon(f"no daemon is listening at {endpoint} (the socket does not exist)")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        if curve is not None:
            secure_client(self._socket, *curve)
        # A command may wait for minutes (a reload); a connection dropped after its handshake means the daemon
        # went away (one dropped before it was turned away, and ZeroMQ connects again), and a refused key that
        # it will not answer.
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._connected = False
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ControlError(f"cannot connect to {endpoint}: {exc.strerror}") from None

    def close(self) -> None:
        """Close the connection."""
        self._monitor.close()
        self._socket.close()
        self._context.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exchange(self, frames: Sequence[Buffer], timeout: float | None = None) -> list[zmq.Frame]:
        """Send one multipart message and wait for one message back."""
        limit = self.timeout if timeout is None else timeout
        self._socket.send_multipart(frames, copy=False)
        return self._receive(limit)

    def call(self, command: str, timeout: float | None = None, on_progress: Callable[[str], None] | None = None,
             until_done: bool = False, **args: Any) -> Any:
        """Run a command and return its result; raise ControlError with the daemon's sentence.

        Progress answers go to `on_progress` until the final answer comes. With
        `until_done`, the wait is not cut at `timeout` but at the end the daemon
        announces in its progress answers (a reload ends within its load timeout),
        or when the connection drops.
        """
        limit = self.timeout if timeout is None else timeout
        self._socket.send(encode_command(command, **args))
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            answer = decode_answer(self._receive(left, limit)[0].buffer)
            if answer.progress is None:
                break
            if on_progress is not None:
                on_progress(answer.progress)
            if until_done and answer.wait_s is not None:
                promised = time.monotonic() + answer.wait_s + FINISH_GRACE_S
                deadline = promised if deadline is None else max(deadline, promised)
                limit = max(limit or 0.0, answer.wait_s + FINISH_GRACE_S)
        return answer_result(command, answer)

    def _receive(self, wait: float | None, limit: float | None = None) -> list[zmq.Frame]:
        """The next message; `wait` seconds at most (None: until the connection drops)."""
        deadline = None if wait is None else time.monotonic() + wait
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(left))
            if self._socket in ready:
                return self._socket.recv_multipart(copy=False)
            if self._monitor in ready:
                event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected = True
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise ControlError(f"the daemon at {self.endpoint} refused this client's CURVE key: add its public "
                                       "key file to the daemon's server.curve_authorized_keys folder")
                elif event == zmq.EVENT_DISCONNECTED and self._connected:
                    raise ControlError(f"the daemon at {self.endpoint} went away before it answered")
                continue
            raise NoAnswer(f"the daemon at {self.endpoint} did not answer within {limit or wait:g} s")
