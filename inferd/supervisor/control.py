"""The control server: the socket `inferctl` talks to.

Each command maps to a `command_<name>` method of a handler object (the
supervisor), so a command and a signal that mean the same thing run the same
code. `infer` hands its wire-format request to the frontend, so it is
validated, batched and answered exactly like a request from a client.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from inferd.ipc.control import Answer, ControlClient, ControlError, decode_command, encode_answer
from inferd.supervisor.frontend import Frontend, ReplyTo

log = logging.getLogger("inferd.control")


class AlreadyRunning(Exception):
    """Another daemon answers on the control endpoint."""


def _socket_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def _check_not_running(endpoint: str) -> None:
    """Refuse to take over the control socket of a daemon that still answers on it."""
    path = _socket_path(endpoint)
    if path is not None and not path.exists():
        return
    try:
        with ControlClient(endpoint, timeout=0.5) as client:
            pid = client.call("status")["pid"]
    except (ControlError, KeyError, TypeError, zmq.ZMQError):
        return
    raise AlreadyRunning(f"another inferd (pid {pid}) is already running with control socket {endpoint}")


def deferred(handler: Callable[..., None]) -> Callable[..., None]:
    """Mark a `command_<name>` handler that answers later, through the ControlReply it is given."""
    handler.deferred = True  # type: ignore[attr-defined]
    return handler


class ControlReply:
    """The way back to one waiting `inferctl`: progress lines, then one final answer."""

    def __init__(self, server: ControlServer, envelope: list[bytes]) -> None:
        self._server = server
        self._envelope = envelope
        self.done = False

    def progress(self, text: str) -> None:
        """Tell the waiting command how far it got."""
        if not self.done:
            self._server.answer(self._envelope, Answer(ok=True, progress=text))

    def finish(self, result: Any) -> None:
        """The command succeeded with `result`."""
        self._final(Answer(ok=True, result=result))

    def fail(self, error: str) -> None:
        """The command failed; `error` is one sentence."""
        self._final(Answer(ok=False, error=error))

    def _final(self, answer: Answer) -> None:
        if not self.done:
            self.done = True
            self._server.answer(self._envelope, answer)


class LoggedReply:
    """A reply nobody waits for (a reload a config change started): its lines go to the log."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = False

    def progress(self, text: str) -> None:
        """Log a step."""
        log.info("%s: %s", self.what, text)

    def finish(self, result: Any) -> None:
        """Log the success."""
        self.done = True
        log.info("%s: done: %s", self.what, result)

    def fail(self, error: str) -> None:
        """Log the failure."""
        self.done = True
        log.error("%s: %s", self.what, error)


class ControlServer:
    """Owns the control socket and routes each command to its handler."""

    def __init__(self, context: zmq.Context, endpoint: str, handler: Any, frontend: Frontend) -> None:
        self.endpoint = endpoint
        self.handler = handler
        self.frontend = frontend
        _check_not_running(endpoint)
        path = _socket_path(endpoint)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.linger = 0
        self.socket.bind(endpoint)
        if path is not None:
            os.chmod(path, 0o660)
        log.info("control socket at %s", endpoint)

    def close(self) -> None:
        """Close the socket and remove its file."""
        self.socket.close(linger=0)
        path = _socket_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)

    def on_readable(self) -> None:
        """Serve every command waiting on the socket."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            envelope = [frames[0].bytes]
            if len(frames) < 2:
                continue
            self._serve(envelope, frames[1].buffer, [f.buffer for f in frames[2:]])

    def _serve(self, envelope: list[bytes], command_frame: memoryview, body: list[memoryview]) -> None:
        reply = ControlReply(self, envelope)
        try:
            command = decode_command(command_frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply.fail(f"malformed command: {exc}")
            return
        if command.command == "infer":
            self.frontend.submit(ReplyTo(self.socket, envelope), body)
            return
        method = getattr(self.handler, f"command_{command.command}", None)
        if method is None:
            reply.fail(f"unknown command {command.command!r}")
            return
        try:
            if getattr(method, "deferred", False):
                method(reply, **command.args)
            else:
                reply.finish(method(**command.args))
        except (TypeError, ValueError) as exc:
            reply.fail(str(exc))

    def answer(self, envelope: list[bytes], answer: Answer) -> None:
        """Send one answer frame to a waiting command."""
        try:
            self.socket.send_multipart([*envelope, encode_answer(answer)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control answer undeliverable: %s", exc.strerror)
