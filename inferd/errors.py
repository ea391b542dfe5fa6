"""Errors a client of inferd can see, one class per reply status that is not `ok`."""

from __future__ import annotations


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


class Cancelled(InferdError):
    """The request was cancelled by the connection that sent it (the daemon dropped it, or its result)."""

    status = "cancelled"


ERROR_BY_STATUS: dict[str, type[InferdError]] = {
    cls.status: cls for cls in (InvalidRequest, Overloaded, Timeout, Unavailable, InferenceError, Cancelled)
}
