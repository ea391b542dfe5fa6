"""The daemon's states, in the order it goes through them, and the error that ends a start."""

from enum import StrEnum


class DaemonState(StrEnum):
    """Where the supervisor is in its life; the value is what status and STATUS= say."""

    STARTING = "starting"  # workers loading and warming; requests are answered `unavailable`
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: queued work finishes, new requests are refused
    STOPPING = "stopping"  # workers are told to exit


class StartupError(Exception):
    """The daemon cannot start; the message says why in one sentence."""
