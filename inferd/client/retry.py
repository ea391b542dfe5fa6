"""The retry policy of a call, and the decision whether a failed attempt is tried again."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from inferd import protocol

RETRY_STATUSES = frozenset({protocol.OVERLOADED, protocol.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """How a call is retried: at most `max_attempts` tries, backoff doubling from
    `initial_delay` up to `max_delay` seconds, each delay varied by +/- `jitter` of itself."""

    max_attempts: int = 3
    initial_delay: float = 0.1
    max_delay: float = 1.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number `attempt + 1` (attempts count from 1)."""
        doublings = min(attempt - 1, 64)  # far past max_delay already; keeps the float finite
        base = min(self.max_delay, self.initial_delay * 2**doublings)
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


@dataclass
class Retry:
    """A call's outcome that is another attempt, `delay` seconds from now."""

    delay: float


def retry_after(policy: RetryPolicy, attempts: int, deadline: float) -> Retry | None:
    """The retry of a call that has made `attempts` attempts and must end by `deadline` (monotonic),
    or None where the policy allows no more or the retry could not be answered in time."""
    if attempts >= policy.max_attempts:
        return None
    delay = policy.delay(attempts)
    # A retry that cannot be answered before the deadline is not worth sending.
    if time.monotonic() + delay >= deadline:
        return None
    return Retry(delay)
