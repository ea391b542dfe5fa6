"""The bounded request queue and the policy that turns it into batches.

Requests wait per model in arrival order. A batch takes requests from the head
of one model's queue while their samples fit in `max_batch_size`. The policy is
work-conserving: when an executor is idle, whatever is waiting goes at once; a
batch is queued behind a running one only when it is full or its oldest
request has waited `max_wait_ms`. Requests whose deadline passes while they
wait are handed back for a `timeout` reply, never computed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from inferd.protocol import Buffer, RequestHeader

# A request's life in the queue; a request leaves exactly once.
WAITING, TAKEN, EXPIRED = range(3)
# Why put() refused a request.
FULL, CLIENT_FULL = "full", "client_full"


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """A validated request, where its reply goes, and its clock (monotonic seconds)."""

    header: RequestHeader
    buffers: list[Buffer]
    reply_to: Any  # the frontend's routing of the reply; opaque here
    client: Hashable  # the connection it came on, for the per-client cap
    samples: int
    received: float
    deadline: float
    state: int = WAITING


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


class BatchQueue:
    """A bounded, lock-protected queue of requests, one lane per model."""

    def __init__(self, max_size: int, policies: dict[str, ModelPolicy], max_per_client: int = 0) -> None:
        self.max_size = max_size
        self.max_per_client = max_per_client
        self._per_client: Counter[Hashable] = Counter()
        self._lanes = {name: _ModelQueue(policy) for name, policy in policies.items()}
        self._order = list(policies)
        self._next_lane = 0
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()
        self._size = 0
        self._lock = threading.Lock()

    def configure(self, max_size: int, max_per_client: int, policies: dict[str, ModelPolicy]) -> None:
        """New bounds and knobs, applied from the next request on; a new model gets its lane."""
        with self._lock:
            self.max_size = max_size
            self.max_per_client = max_per_client
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

    def put(self, request: QueuedRequest) -> str | None:
        """Enqueue, or (changing nothing) say why not: FULL, or CLIENT_FULL for a client at its cap."""
        with self._lock:
            if self._size >= self.max_size:
                return FULL
            if self.max_per_client and self._per_client[request.client] >= self.max_per_client:
                return CLIENT_FULL
            lane = self._lanes[request.header.model]
            lane.requests.append(request)
            lane.samples += request.samples
            self._size += 1
            self._per_client[request.client] += 1
            heapq.heappush(self._deadlines, (request.deadline, next(self._seq), request))
            if len(self._deadlines) > 2 * self.max_size + 1024:
                # Long deadlines of requests long gone pile up below the top; rebuild.
                self._deadlines = [entry for entry in self._deadlines if entry[2].state == WAITING]
                heapq.heapify(self._deadlines)
            return None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every waiting request whose deadline is at or before `now`."""
        expired = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                request = heapq.heappop(self._deadlines)[2]
                if request.state != WAITING:
                    continue
                lane = self._lanes[request.header.model]
                lane.requests.remove(request)
                lane.samples -= request.samples
                self._size -= 1
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
        with self._lock:
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
        with self._lock:
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
        with self._lock:
            drained = [r for lane in self._lanes.values() for r in lane.requests]
            for lane in self._lanes.values():
                lane.requests.clear()
                lane.samples = 0
            for request in drained:
                request.state = TAKEN
            self._per_client.clear()
            self._size = 0
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
        self._size -= len(batch)
        self._drop_settled_deadlines()
        return batch

    def queued_by(self, client: Hashable) -> int:
        """Requests `client` has waiting."""
        return self._per_client[client]

    def _left(self, request: QueuedRequest) -> None:
        count = self._per_client[request.client] - 1
        if count:
            self._per_client[request.client] = count
        else:
            del self._per_client[request.client]

    def _drop_settled_deadlines(self) -> None:
        # Entries of requests that already left sit in the heap until they reach
        # its top; dropping them there keeps the heap from growing without bound.
        while self._deadlines and self._deadlines[0][2].state != WAITING:
            heapq.heappop(self._deadlines)
