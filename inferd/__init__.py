"""inferd: a multiprocess inference daemon with dynamic batching over shared memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from inferd.errors import (
    Cancelled,
    InferdError,
    InferenceError,
    InvalidInput,
    InvalidRequest,
    Overloaded,
    Timeout,
    Unavailable,
)

if TYPE_CHECKING:
    from inferd.client import AsyncClient, Client, RetryPolicy

_CLIENT_NAMES = ("AsyncClient", "Client", "RetryPolicy")


def __getattr__(name: str) -> Any:
    # The client is imported when a program first asks for it, so the supervisor, the workers and the
    # gateways, which import inferd's modules but never the client, do not load it.
    if name in _CLIENT_NAMES:
        from inferd import client

        return getattr(client, name)
    raise AttributeError(f"module 'inferd' has no attribute {name!r}")

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "InferdError",
    "InferenceError",
    "InvalidInput",
    "InvalidRequest",
    "Overloaded",
    "RetryPolicy",
    "Timeout",
    "Unavailable",
    "__version__",
]
