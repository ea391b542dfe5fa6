"""The control server: the socket `inferctl` talks to.

Each command maps to a `command_<name>` method of a handler object
(commands.py), so a command and a signal that mean the same thing
run the same code. `infer` hands its wire-format request to the frontend, so it is
validated, batched and answered exactly like a request from a client.
"""

from __future__ import annotations

import inspect
import logging
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from inferd.errors import cut
from inferd.ipc.control import Answer, ControlClient, ControlError, decode_command, encode_answer
from inferd.ipc.curve import CurveServer
from inferd.ipc.sockets import bind_error
from inferd.supervisor.dispatch.replies import ReplyTo
from inferd.supervisor.intake.frontend import Frontend
from inferd.supervisor.shared.backstop import failure
from inferd.supervisor.shared.state import StartupError

log = logging.getLogger("inferd.control")


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
    raise StartupError(f"another inferd (pid {pid}) is already running with control socket {endpoint}")


def deferred(handler: Callable[..., None]) -> Callable[..., None]:
    """Mark a `command_<name>` handler that answers later, through the ControlReply it is given."""
    handler.deferred = True  # type: ignore[attr-defined]
    return handler


# How an argument's type is said to a client that sent another.
TYPE_WORDS = {str: "a string", float: "a number", int: "a whole number", bool: "true or false", type(None): "null"}


def checked_arguments(command: str, method: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """`args` as `method` takes them; ValueError with the sentence for arguments it does not take, required ones
    left out, or one of another type than it takes (a JSON client's, which inferctl's options never send: a
    `"confirm": "no"` would otherwise count as true, a number as a model's name)."""
    parameters = [p for p in inspect.signature(method).parameters.values() if p.name != "reply"]
    known = [p.name for p in parameters]
    unknown = sorted(set(args) - set(known))
    takes = f"it takes {', '.join(known)}" if known else "it takes none"
    if unknown:
        raise ValueError(f"{command} has no argument {', '.join(map(repr, unknown))}; {takes}")
    missing = [p.name for p in parameters if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        raise ValueError(f"{command} needs the argument {', '.join(map(repr, missing))}; {takes}")
    hints = typing.get_type_hints(method)
    checked = {}
    for name, value in args.items():
        try:
            checked[name] = msgspec.convert(value, hints[name], strict=True)
        except msgspec.ValidationError:
            kinds = " or ".join(TYPE_WORDS.get(kind, str(kind)) for kind in typing.get_args(hints[name]) or
                                (hints[name],))
            raise ValueError(f"{command}'s argument {name!r} is {kinds}, not {cut(repr(value))}") from None
    return checked


class ControlReply:
    """The way back to one waiting `inferctl`: progress lines, then one final answer."""

    def __init__(self, server: ControlServer, envelope: list[bytes]) -> None:
        self._server = server
        self._envelope = envelope
        self.done = False

    def progress(self, text: str, wait_s: float | None = None) -> None:
        """Tell the waiting command how far it got (and, with `wait_s`, how long the rest may take)."""
        if not self.done:
            self._server.answer(self._envelope, Answer(ok=True, progress=text, wait_s=wait_s))

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


class ControlServer:
    """Owns the control socket and routes each command to its handler."""

    def __init__(self, context: zmq.Context, endpoint: str, handler: Any, frontend: Frontend,
                 curve: CurveServer) -> None:
        self.endpoint = endpoint
        self.handler = handler
        self.frontend = frontend
        self._curve = curve
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.linger = 0
        self._bound = False

    def bind(self) -> None:
        """Take the control endpoint: refused when another daemon answers on it, or when it is tcp://
        without CURVE (whoever reaches the port could reload models)."""
        if self.endpoint.startswith("tcp://"):
            if not self._curve.enabled:
                raise StartupError(f"server.control {self.endpoint} is a tcp endpoint without CURVE: anyone who "
                                   "reaches it could reload models; set server.curve_secret_key and "
                                   "server.curve_authorized_keys, or use an ipc:// control socket")
            self._curve.secure(self.socket)
            # Whoever reaches the port can connect, key or none: its connections count as clients' do.
            self.frontend.connections.count(self.socket)
        _check_not_running(self.endpoint)
        path = _socket_path(self.endpoint)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot open the control socket {self.endpoint} ({bind_error(exc)}); change "
                               "server.control") from None
        self._bound = True
        if path is not None:
            os.chmod(path, 0o660)
        log.info("control socket at %s", self.endpoint)

    def close(self) -> None:
        """Close the socket and remove its file (only if this daemon bound it)."""
        self.socket.close(linger=0)
        path = _socket_path(self.endpoint)
        if path is not None and self._bound:
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
            try:
                self._serve(envelope, frames[1].buffer, [f.buffer for f in frames[2:]])
            except Exception:  # noqa: BLE001 - the last guard: one command never takes the daemon down
                ControlReply(self, envelope).fail(failure("a control command"))

    def _serve(self, envelope: list[bytes], command_frame: memoryview, body: list[memoryview]) -> None:
        reply = ControlReply(self, envelope)
        try:
            command = decode_command(command_frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply.fail(f"malformed command: {exc}")
            return
        except RecursionError:
            reply.fail("malformed command: it nests deeper than any command does")
            return
        if command.command == "infer":
            self.frontend.submit(ReplyTo(self.socket, envelope), body)
            return
        method = getattr(self.handler, f"command_{command.command}", None)
        if method is None:
            reply.fail(f"unknown command {command.command!r}")
            return
        try:
            args = checked_arguments(command.command, method, command.args)
            if getattr(method, "deferred", False):
                method(reply, **args)
            else:
                reply.finish(method(**args))
        except ValueError as exc:
            reply.fail(str(exc))

    def answer(self, envelope: list[bytes], answer: Answer) -> None:
        """Send one answer frame to a waiting command."""
        try:
            self.socket.send_multipart([*envelope, encode_answer(answer)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control answer undeliverable: %s", exc.strerror)
