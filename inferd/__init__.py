"""inferd: a multiprocess inference daemon with dynamic batching over shared memory."""

__version__ = "0.1.0"

from inferd.client import AsyncClient, Client, RetryPolicy
from inferd.errors import (
    Cancelled,
    InferdError,
    InferenceError,
    InvalidRequest,
    Overloaded,
    Timeout,
    Unavailable,
)

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "InferdError",
    "InferenceError",
    "InvalidRequest",
    "Overloaded",
    "RetryPolicy",
    "Timeout",
    "Unavailable",
    "__version__",
]
