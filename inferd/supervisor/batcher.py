"""The bounded request queue and the policy that turns it into batches.

Requests wait per model in arrival order. A batch takes requests from the head
of one model's queue while their samples fit in `max_batch_size`. The policy is
work-conserving: when an executor is idle, whatever is waiting goes at once; a
batch is queued behind a running one only when it is full or its oldest
request has waited `max_wait_ms`. Lanes are served round-robin, so a model's
lone request never waits behind another model's backlog. Requests whose
deadline passes while they wait are handed back for a `timeout` reply, never
computed.

The queue is bounded in requests and in bytes, over all and per connection.
Only the supervisor's loop thread touches it (the frontend puts, the loop takes
and expires), so it takes no lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from inferd.config import Config
from inferd.protocol import Buffer, RequestHeader
from inferd.supervisor.regions import Region, RegionSlice

# A request's life in the queue; a request leaves exactly once.
WAITING, TAKEN, EXPIRED = range(3)


class Refusal(StrEnum):
    """Why put() refused a request."""

    FULL = "full"  # queue.max_size requests wait
    BYTES = "bytes"  # queue.max_bytes would be passed
    CLIENT_FULL = "client_full"  # its connection has queue.max_per_client waiting
    CLIENT_BYTES = "client_bytes"  # its connection would pass queue.max_bytes_per_client


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """A validated request, where its reply goes, and its clock (monotonic seconds)."""

    header: RequestHeader
    buffers: list[Buffer | RegionSlice]  # each input: its bytes, or where in a client's region they lie
    reply_to: Any  # the frontend's routing of the reply; opaque here
    client: Hashable  # the connection it came on, for the per-client cap
    samples: int
    nbytes: int  # the payload it holds (its input buffers)
    received: float
    deadline: float
    state: int = WAITING
    places: tuple[tuple[Region, int] | None, ...] = ()  # per output: the region and offset to write it at


@dataclass
class ModelPolicy:
    """The batching knobs of one model."""

    max_batch_size: int
    max_wait_s: float


@dataclass
class _ModelQueue:
    policy: ModelPolicy
    requests: deque = field(default_factory=deque)
    samples: int = 0


@dataclass(frozen=True)
class Bounds:
    """How much may wait: requests and bytes, over all and per connection (0 requests: no cap)."""

    max_size: int
    max_bytes: int
    max_per_client: int
    max_bytes_per_client: int


def queue_settings(config: Config) -> tuple[Bounds, dict[str, ModelPolicy]]:
    """The queue's bounds and each model's batching knobs, from the config."""
    queue = config.queue
    bounds = Bounds(queue.max_size, queue.max_bytes, queue.max_per_client, queue.max_bytes_per_client)
    return bounds, {name: ModelPolicy(m.max_batch_size, m.max_wait_ms / 1000) for name, m in config.models.items()}


class BatchQueue:
    """A bounded queue of requests, one lane per model."""

    def __init__(self, bounds: Bounds, policies: dict[str, ModelPolicy]) -> None:
        self.bounds = bounds
        self._per_client: Counter[Hashable] = Counter()
        self._bytes_per_client: Counter[Hashable] = Counter()
        self._lanes: dict[str, _ModelQueue] = {}
        self._order: list[str] = []
        self._next_lane = 0
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()
        self._size = 0
        self.nbytes = 0
        self.configure(bounds, policies)

    def configure(self, bounds: Bounds, policies: dict[str, ModelPolicy]) -> None:
        """New bounds and knobs, applied from the next request on; a new model gets its lane."""
        self.bounds = bounds
        for name, policy in policies.items():
            if name in self._lanes:
                self._lanes[name].policy = policy
            else:
                self._lanes[name] = _ModelQueue(policy)
                self._order.append(name)

    def __len__(self) -> int:
        return self._size

    def depth(self, model: str) -> int:
        """Requests waiting for `model`."""
        return len(self._lanes[model].requests)

    def refusal(self, client: Hashable, nbytes: int) -> Refusal | None:
        """Why a request of `nbytes` from `client` would be refused now; None when it fits."""
        bounds = self.bounds
        if self._size >= bounds.max_size:
            return Refusal.FULL
        if self.nbytes + nbytes > bounds.max_bytes:
            return Refusal.BYTES
        if bounds.max_per_client and self._per_client[client] >= bounds.max_per_client:
            return Refusal.CLIENT_FULL
        if self._bytes_per_client[client] + nbytes > bounds.max_bytes_per_client:
            return Refusal.CLIENT_BYTES
        return None

    def put(self, request: QueuedRequest) -> Refusal | None:
        """Enqueue, or (changing nothing) say why not."""
        bounds, client, nbytes = self.bounds, request.client, request.nbytes
        # The bounds in one expression: this runs for every request.
        if (self._size >= bounds.max_size or self.nbytes + nbytes > bounds.max_bytes
                or (bounds.max_per_client and self._per_client[client] >= bounds.max_per_client)
                or self._bytes_per_client[client] + nbytes > bounds.max_bytes_per_client):
            return self.refusal(client, nbytes)
        lane = self._lanes[request.header.model]
        lane.requests.append(request)
        lane.samples += request.samples
        self._size += 1
        self.nbytes += nbytes
        self._per_client[client] += 1
        self._bytes_per_client[client] += nbytes
        heapq.heappush(self._deadlines, (request.deadline, next(self._seq), request))
        if len(self._deadlines) > 2 * bounds.max_size + 1024:
            # Long deadlines of requests long gone pile up below the top; rebuild.
            self._deadlines = [entry for entry in self._deadlines if entry[2].state == WAITING]
            heapq.heapify(self._deadlines)
        return None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every waiting request whose deadline is at or before `now`."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if request.state != WAITING:
                continue
            lane = self._lanes[request.header.model]
            lane.requests.remove(request)
            lane.samples -= request.samples
            self._left(request)
            request.state = EXPIRED
            expired.append(request)
        self._drop_settled_deadlines()
        return expired

    def take(self, capacity: Callable[[str], tuple[bool, bool]], now: float) -> tuple[str, list[QueuedRequest]] | None:
        """The next batch to send, or None when the policy says wait.

        `capacity(model)` says whether an executor that can run the model is idle,
        and whether one could queue one more batch behind the one it runs. Lanes
        are served round-robin, so a model with a long backlog cannot starve
        another model's requests.
        """
        for step in range(len(self._order)):
            name = self._order[(self._next_lane + step) % len(self._order)]
            lane = self._lanes[name]
            if not lane.requests:
                continue
            idle, spare = capacity(name)
            if idle or (spare and self._full_or_aged(lane, now)):
                self._next_lane = (self._next_lane + step + 1) % len(self._order)
                return name, self._pop_batch(lane)
        return None

    def next_wakeup(self, now: float) -> float | None:
        """Seconds until the policy may change its mind by itself (a batch ages, a deadline passes).

        A lane already full or aged is not counted: it waits for an executor, whose
        answer wakes the loop anyway.
        """
        times = [
            lane.requests[0].received + lane.policy.max_wait_s
            for lane in self._lanes.values()
            if lane.requests and lane.samples < lane.policy.max_batch_size
            and lane.requests[0].received + lane.policy.max_wait_s > now
        ]
        if self._deadlines:
            times.append(self._deadlines[0][0])
        return max(0.0, min(times) - now) if times else None

    def drain(self) -> list[QueuedRequest]:
        """Remove and return every waiting request (for a forced stop)."""
        drained = [r for lane in self._lanes.values() for r in lane.requests]
        for lane in self._lanes.values():
            lane.requests.clear()
            lane.samples = 0
        for request in drained:
            request.state = TAKEN
        self._per_client.clear()
        self._bytes_per_client.clear()
        self._size = 0
        self.nbytes = 0
        self._deadlines.clear()
        return drained

    @staticmethod
    def _full_or_aged(lane: _ModelQueue, now: float) -> bool:
        return (
            lane.samples >= lane.policy.max_batch_size
            or now - lane.requests[0].received >= lane.policy.max_wait_s
        )

    def _pop_batch(self, lane: _ModelQueue) -> list[QueuedRequest]:
        batch: list[QueuedRequest] = []
        samples = 0
        limit = lane.policy.max_batch_size
        # The head request always goes, even over a max_batch_size lowered (SIGHUP) since
        # it was accepted: the slot was sized for the old limit, and leaving it would jam the lane.
        while lane.requests and (not batch or samples + lane.requests[0].samples <= limit):
            request = lane.requests.popleft()
            request.state = TAKEN
            self._left(request)
            samples += request.samples
            batch.append(request)
        lane.samples -= samples
        self._drop_settled_deadlines()
        return batch

    def queued_by(self, client: Hashable) -> int:
        """Requests `client` has waiting."""
        return self._per_client[client]

    def _left(self, request: QueuedRequest) -> None:
        self._size -= 1
        self.nbytes -= request.nbytes
        client = request.client
        count = self._per_client[client] - 1
        if count:
            self._per_client[client] = count
            self._bytes_per_client[client] -= request.nbytes
        else:
            del self._per_client[client]
            del self._bytes_per_client[client]

    def _drop_settled_deadlines(self) -> None:
        # Entries of requests that already left sit in the heap until they reach
        # its top; dropping them there keeps the heap from growing without bound.
        while self._deadlines and self._deadlines[0][2].state != WAITING:
            heapq.heappop(self._deadlines)
