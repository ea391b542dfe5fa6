"""Errors a client of inferd can see, one class per reply status that is not `ok`, and how their sentences
quote what a client sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

QUOTED_CHARS = 200  # the most of a client's value an error sentence repeats
MODEL_ERROR_CHARS = 500  # the most of a model's exception message an error reply carries


class InferdError(Exception):
    """Base of every error inferd raises to its users.

    `status` is the reply status that carries this error on the wire; `request_id`
    is the id of the request it answers, where one is known.
    """

    status = "internal"

    def __init__(self, message: str, request_id: int | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class InvalidRequest(InferdError):
    """The request is wrong: unknown model, bad dtype or shape, malformed message."""

    status = "invalid"


class Overloaded(InferdError):
    """The daemon's queue is full; retry later."""

    status = "overloaded"


class Timeout(InferdError):
    """The deadline passed before the request ran, or before its reply arrived."""

    status = "timeout"


class Unavailable(InferdError):
    """No live version, no ready worker, or the daemon is draining."""

    status = "unavailable"


class InferenceError(InferdError):
    """The worker failed while computing the request."""

    status = "internal"


class InvalidInput(InvalidRequest):
    """Raised by a Python model's code (`raise inferd.InvalidInput("...")`) for a request whose input it cannot
    take: the request is answered `invalid` (HTTP 400, gRPC INVALID_ARGUMENT) with the message, where any other
    exception is answered `internal`."""


class Cancelled(InferdError):
    """The request was cancelled by the connection that sent it (the daemon dropped it, or its result)."""

    status = "cancelled"


ERROR_BY_STATUS: dict[str, type[InferdError]] = {
    cls.status: cls for cls in (InvalidRequest, Overloaded, Timeout, Unavailable, InferenceError, Cancelled)
}


def quoted(value: Any) -> str:
    """A value a client sent (a name, a shape, a header...), as an error sentence quotes it: its repr, cut to
    QUOTED_CHARS characters and said to be cut, so that an answer never repeats a client's value at any size.
    A large value costs no more than the characters shown."""
    text = ""
    for piece in _repr_pieces(value):
        text += piece
        if len(text) > QUOTED_CHARS:
            break
    return cut(text)


def cut(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text`, from a client or made of what it sent (or a model's exception message), cut to `limit` characters
    and said to be cut."""
    return text if len(text) <= limit else f"{text[:limit]}... (cut at {limit} characters)"


def _repr_pieces(value: Any) -> Iterator[str]:
    """`value`'s repr, piece by piece, as far as it is read; a string is cut before its repr is taken."""
    if isinstance(value, (str, bytes)):
        yield repr(value[:QUOTED_CHARS + 1])
    elif isinstance(value, (list, tuple)):
        yield "[" if isinstance(value, list) else "("
        for index, item in enumerate(value):
            if index:
                yield ", "
            yield from _repr_pieces(item)
        yield "]" if isinstance(value, list) else ",)" if len(value) == 1 else ")"
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            if index:
                yield ", "
            yield from _repr_pieces(key)
            yield ": "
            yield from _repr_pieces(item)
        yield "}"
    else:
        yield repr(value)
