"""One logical request across its attempts: what to send, and what each answer means."""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from inferd import protocol
from inferd.client.endpoints import Endpoint
from inferd.client.retry import RETRY_STATUSES, Retry, RetryPolicy, retry_after
from inferd.errors import ERROR_BY_STATUS, InferdError, Timeout, Unavailable

Outputs = np.ndarray | tuple[np.ndarray, ...]
Encode = Callable[[int], list[protocol.Buffer]]  # the time left in ms -> the message of an attempt
Result = Callable[[protocol.ReplyHeader, list[np.ndarray]], Any]  # an `ok` reply -> what the caller gets


class Reply(NamedTuple):
    """A request's answer in full (`details=True`): its outputs as `infer` returns them, the version that
    computed them (a pipeline's names its steps' versions), and the daemon's timing of it in microseconds:
    `queue` from arrival to dispatch, `compute` the worker's time for the whole batch, `total` from arrival
    to reply."""

    outputs: Outputs
    version: str
    timing_us: protocol.Timing


def outputs_of(header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Outputs:
    """What `infer` returns: the one output, or a tuple of several."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def reply_of(header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Reply:
    """What a call with `details` gives. Every `ok` reply of inferd carries a version and a timing."""
    return Reply(outputs_of(header, outputs), header.version or "", header.timing_us or protocol.Timing(0, 0, 0))


def call_timeout(timeout: float) -> float:
    """`timeout`, the seconds a call may take; ValueError unless it is finite and above zero (infinity or NaN
    would be no deadline the daemon can keep, and 0 one that passes before any daemon is reached)."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds above zero, got {timeout!r}")
    return timeout


class Call:
    """One logical request across its attempts: what to send, and what each answer means."""

    def __init__(self, request_id: int, encode: Encode, timeout: float, policy: RetryPolicy,
                 result: Result = outputs_of) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.endpoint: Endpoint | None = None  # where the current attempt is in flight
        self.avoid: Endpoint | None = None  # where the last attempt failed: elsewhere first
        self.id = request_id
        self.encode = encode
        self.result = result
        self.timeout = call_timeout(timeout)
        self.deadline = time.monotonic() + self.timeout
        self.policy = policy
        self.attempts = 0

    def frames(self) -> list[protocol.Buffer]:
        """The next attempt's message, carrying the time left as its timeout."""
        self.attempts += 1
        return self.encode(max(1, int((self.deadline - time.monotonic()) * 1000)))

    def settle(self, header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Any:
        """The call's result, its error, or a retry after a delay."""
        if header.status == protocol.OK:
            return self.result(header, outputs)
        if header.status in RETRY_STATUSES:
            retry = retry_after(self.policy, self.attempts, self.deadline)
            if retry is not None:
                return retry
        cls = ERROR_BY_STATUS.get(header.status, InferdError)
        return cls(header.error or header.status, self.id)

    def missed(self) -> InferdError | Retry:
        """The connection dropped with this call in flight: retry, or give up."""
        return (retry_after(self.policy, self.attempts, self.deadline)
                or Unavailable("the connection to the daemon dropped before the reply came", self.id))

    def refused(self) -> Unavailable:
        """The daemon refused this client's CURVE key: retrying cannot help."""
        return Unavailable("the daemon refused this client's CURVE key (is its public key in the daemon's "
                           "server.curve_authorized_keys folder?)", self.id)

    def expired(self, unreachable: str | None = None) -> Timeout:
        """The error of a call whose deadline passed with no reply (and why, if no daemon could be reached)."""
        reason = f": no daemon reachable at {unreachable}" if unreachable else ""
        return Timeout(f"no reply within {self.timeout:g} s{reason}", self.id)
