"""The bytes a gateway process lets its unfinished requests hold (server.gateway_buffer_mb).

A request's body is held from its first byte until its answer has gone: while it arrives, while it
is inflated and parsed, while the daemon computes it. Without a bound, a few clients that start
large bodies and never finish them take the gateway's memory (twenty 64 MiB bodies, a gigabyte).
Each request takes what it holds from one budget per gateway process, and gives it back once, when
it ends; a request that does not fit is refused at once (503 with Retry-After, gRPC UNAVAILABLE),
so the clients already in have their bodies read and answered.
"""

from __future__ import annotations

import asyncio
import collections

MIB = 1 << 20


SMALL_BODY = 64 << 10  # a request that holds no more than this may use the budget's reserve


class BodyBudget:
    """What the unfinished requests of this process may hold, in bytes, and what they hold now.

    With a `reserve`, only requests that hold at most SMALL_BODY may take its last `reserve` bytes: a few
    large bodies then leave room for the many small requests of everyone else."""

    def __init__(self, limit: int, reserve: int = 0) -> None:
        self.limit = limit
        self.held = 0
        self._large_limit = limit - reserve
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def take(self, size: int, total: int | None = None) -> bool:
        """Hold `size` bytes more, for a request that then holds `total` (default `size`), if they fit (and
        nobody waits for room before them); False if not."""
        limit = self.limit if (size if total is None else total) <= SMALL_BODY else self._large_limit
        if self._waiting or self.held + size > limit:
            return False
        self.held += size
        return True

    async def wait_for(self, size: int, timeout: float) -> bool:
        """Hold `size` bytes once they fit, in turn with the others waiting; False if that takes over
        `timeout` seconds."""
        if self.take(size):
            return True
        room = asyncio.get_running_loop().create_future()
        entry = (size, room)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(room), timeout)
            return True
        except TimeoutError:
            if room.done():  # given room just as the wait ended: it is this caller's to use
                return True
            self._waiting.remove(entry)
            self._admit_waiting()  # the one behind may fit where this one did not
            return False
        except asyncio.CancelledError:
            if room.done() and not room.cancelled():
                self.give(size)
            elif entry in self._waiting:
                self._waiting.remove(entry)
                self._admit_waiting()
            raise

    def give(self, size: int) -> None:
        """Give back `size` bytes taken before."""
        self.held -= size
        self._admit_waiting()

    @property
    def contended(self) -> bool:
        """Whether a request waits for room."""
        return bool(self._waiting)

    def _admit_waiting(self) -> None:
        while self._waiting and self.held + self._waiting[0][0] <= self._large_limit:
            size, room = self._waiting.popleft()
            self.held += size
            room.set_result(None)

    def refusal(self, size: int | None = None) -> str:
        """The sentence a request that does not fit is refused with."""
        what = "this request" if size is None else f"this request's {size} bytes"
        return (f"the gateway's unfinished requests hold {self.held / MIB:.0f} MiB of its "
                f"{self.limit / MIB:.0f} MiB (server.gateway_buffer_mb), and {what} would not fit; retry later")


class Hold:
    """What one request holds of a BodyBudget; given back once, by release()."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def take(self, size: int) -> bool:
        """Hold `size` bytes more for this request; False (and nothing taken) if they do not fit."""
        if not self._budget.take(size, self.size + size):
            return False
        self.size += size
        return True

    async def wait_for(self, size: int, timeout: float) -> bool:
        """Hold `size` bytes more once they fit (BodyBudget.wait_for); False if that takes over `timeout` s."""
        if not await self._budget.wait_for(size, timeout):
            return False
        self.size += size
        return True

    def keep(self, size: int) -> None:
        """Hold only `size` of what this request holds (the rest was a bound, not bytes it has)."""
        if size < self.size:
            self._budget.give(self.size - size)
            self.size = size

    def release(self) -> None:
        """Give back everything this request holds (again: nothing)."""
        if self.size:
            self._budget.give(self.size)
            self.size = 0
