"""What an HTTP request's body may take: its share of the gateway's buffer, and the time it arrives in.

The server (http_server.GuardedProtocol) makes a BodyGuard for each request once its head is in, and
the app (rest.RestApp) reads the body through it: a body whose Content-Length does not fit what is
left of server.gateway_buffer_mb is refused before a byte of it is read; a chunked one is counted as
it arrives and cut where it would pass the bound; one that arrives slower than server.min_body_kib_s
over any PACE_WINDOW_S is cut (a client that sends a byte every few seconds would otherwise hold its
buffer for as long as it likes). A refusal is the request's answer, with its connection closed after
it: the rest of the body is never read.
"""

from __future__ import annotations

import collections

from inferd.oip.budget import BodyBudget, Hold

PACE_WINDOW_S = 10  # the window over which a body's pace is judged, in seconds (one tick a second)


class BodyRefused(Exception):
    """A request's answer decided by its guard: an HTTP status, one sentence, and its headers."""

    def __init__(self, status: int, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # The body's unread rest must not be taken for the next request: the connection ends after the answer.
        self.headers = [(b"connection", b"close"), *([(b"retry-after", b"1")] if retry else [])]


class BodyGuard:
    """One request's body: what it holds of the gateway's budget, whether it is refused, and its pace."""

    __slots__ = ("_budget", "_hold", "_pace", "_received", "expected", "refusal")

    def __init__(self, budget: BodyBudget, expected: int | None, chunked: bool, max_bytes: int) -> None:
        """`expected`: the Content-Length (None: none, or chunked); `max_bytes`: server.max_message_mb in bytes."""
        self._budget = budget
        self._hold = Hold(budget)
        self.expected = None if chunked else expected
        self.refusal: BodyRefused | None = None
        self._received = 0
        self._pace: collections.deque[int] = collections.deque(maxlen=PACE_WINDOW_S + 1)
        if self.expected is None or self.expected == 0:
            return
        if self.expected > max_bytes:
            self.refusal = BodyRefused(413, f"the request body is {self.expected} bytes, over {max_bytes} "
                                            "(server.max_message_mb)")
        elif not self._hold.take(self.expected):
            self.refusal = BodyRefused(503, budget.refusal(self.expected), retry=True)

    def arrived(self, size: int) -> bool:
        """`size` bytes more of the body came: False (and the request refused) if a chunked body would pass
        the budget with them."""
        self._received += size
        if self.refusal is not None:
            return False
        if self.expected is None and not self._hold.take(size):
            self.refusal = BodyRefused(503, self._budget.refusal(), retry=True)
            self._hold.release()  # what it held is dropped as it is answered: room for the others' bodies now
            return False
        return True

    def take(self, size: int) -> None:
        """Hold `size` bytes more for what the request's body becomes (inflated); BodyRefused if they do not fit."""
        if not self._hold.take(size):
            raise BodyRefused(503, self._budget.refusal(size), retry=True)

    def tick(self, min_bytes_s: int, paused: bool) -> BodyRefused | None:
        """A second has passed while the body arrives: its refusal if less than `min_bytes_s` a second (and at
        least a byte) came over the last PACE_WINDOW_S, where no more than that was left to come. Seconds in
        which the server did not read (`paused`: the app had not taken what came) start the window again."""
        if paused:
            self._pace.clear()
            return None
        self._pace.append(self._received)
        if len(self._pace) <= PACE_WINDOW_S:
            return None
        came = self._received - self._pace[0]
        left = float("inf") if self.expected is None else self.expected - self._pace[0]
        wanted = max(1, min(min_bytes_s * PACE_WINDOW_S, left))
        if came >= wanted:
            return None
        self.refusal = BodyRefused(408, f"the request body came at {came / PACE_WINDOW_S / 1024:.1f} KiB/s over "
                                        f"the last {PACE_WINDOW_S} s, under server.min_body_kib_s "
                                        f"({min_bytes_s / 1024:g}); send it faster")
        self._hold.release()
        return self.refusal

    def release(self) -> None:
        """The request has ended: give back what it held."""
        self._hold.release()
