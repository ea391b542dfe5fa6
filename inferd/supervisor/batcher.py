"""The bounded request queue and the policy that turns it into batches.

Requests wait per model and per priority level (0 the most urgent), each level
in arrival order. A batch is led by the most urgent level waiting and filled
from the levels after it while its samples fit in `max_batch_size`. No level
starves: one that waited through `1 / priority_share - 1` batches in a row
without a request in them leads the next one.

The policy is work-conserving: when an executor is idle, whatever is waiting
goes at once; a batch is queued behind a running one only when it is full, or
when its oldest request has waited `max_wait_ms`, or (the "auto" window) when
an executor is about to be free or a deadline in the batch says go. Lanes
are served round-robin, so a model's lone request never waits behind another
model's backlog. Requests whose deadline passes while they wait are handed back
for a `timeout` reply, never computed.

The queue is bounded in requests and in bytes, over all and per connection;
when it is full, an urgent request may displace the newest one of a less urgent
level. Only the supervisor's loop thread touches it (the frontend puts and
cancels, the loop takes and expires), so it takes no lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

from inferd.config import Config
from inferd.protocol import Buffer, RequestHeader, RequestId
from inferd.supervisor.regions import Region, RegionSlice

# A request's life in the queue; a request leaves exactly once (REMOVED: displaced or cancelled).
WAITING, TAKEN, EXPIRED, REMOVED = range(4)
# The "auto" window sends a batch this long before its executor is expected to be free: the time to
# stack it and for the worker to pick it up, so the executor never waits for it.
AUTO_LEAD_S = 0.001  # and the loop's poll wakes on whole milliseconds
URGENT_MEMORY_S = 1.0  # a level that took a request this recently may send more: a full batch waits for them


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
    priority: int = 0
    state: int = WAITING
    places: tuple[tuple[Region, int] | None, ...] = ()  # per output: the region and offset to write it at
    cancelled: bool = False  # its client cancelled it while its batch ran: the result is dropped


@dataclass
class ModelPolicy:
    """The batching knobs of one model; `max_wait_s` None is the "auto" window."""

    max_batch_size: int
    max_wait_s: float | None


@dataclass(frozen=True)
class Levels:
    """The priority levels: how many, the level of a request that names none, and the least share of
    batches a waiting level leads."""

    count: int = 1
    default: int = 0
    share: float = 0.1

    @property
    def patience(self) -> int:
        """Batches in a row a waiting level may be left out of before it leads the next."""
        return max(1, math.floor(1 / self.share + 1e-9) - 1)


class Capacity(NamedTuple):
    """What the executors of a model can take now: one is idle; one can queue one more batch behind
    the one it runs; and when (monotonic) such a one is expected to be free."""

    idle: bool
    spare: bool
    free_at: float = 0.0


class BatchTimes(Protocol):
    """Expected compute seconds of a batch of a model, by its samples (None: not yet measured)."""

    def batch_s(self, model: str, samples: int) -> float | None: ...


@dataclass
class _ModelQueue:
    policy: ModelPolicy
    levels: list[deque[QueuedRequest]]
    samples: int = 0
    level_samples: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)  # per level: batches in a row it waited through unserved
    seen: list[float] = field(default_factory=list)  # per level: when its latest request arrived
    go_at: float | None = None  # the "auto" window: when the waiting batch goes

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    def oldest(self) -> QueuedRequest:
        """The request that has waited longest (the lane is not empty)."""
        return min((level[0] for level in self.levels if level), key=lambda r: r.received)


@dataclass(frozen=True)
class Bounds:
    """How much may wait: requests and bytes, over all and per connection (0 requests: no cap)."""

    max_size: int
    max_bytes: int
    max_per_client: int
    max_bytes_per_client: int


def queue_settings(config: Config) -> tuple[Bounds, dict[str, ModelPolicy], Levels]:
    """The queue's bounds, each model's batching knobs and the priority levels, from the config."""
    queue = config.queue
    bounds = Bounds(queue.max_size, queue.max_bytes, queue.max_per_client, queue.max_bytes_per_client)
    policies = {
        name: ModelPolicy(m.max_batch_size, None if m.max_wait_ms == "auto" else m.max_wait_ms / 1000)
        for name, m in config.models.items()
    }
    return bounds, policies, Levels(queue.priority_levels, queue.default_level, queue.priority_share)


class _NoTimes:
    def batch_s(self, model: str, samples: int) -> float | None:
        return None


NO_TIMES = _NoTimes()


class BatchQueue:
    """A bounded queue of requests, one lane per model, one level per priority in each lane."""

    def __init__(self, bounds: Bounds, policies: dict[str, ModelPolicy], levels: Levels = Levels(),
                 times: BatchTimes = NO_TIMES) -> None:
        self.bounds = bounds
        self.levels = levels
        self._times = times
        self._per_client: Counter[Hashable] = Counter()
        self._bytes_per_client: Counter[Hashable] = Counter()
        self._lanes: dict[str, _ModelQueue] = {}
        self._order: list[str] = []
        self._next_lane = 0
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()
        self._size = 0
        self.nbytes = 0
        self.configure(bounds, policies, levels)

    def configure(self, bounds: Bounds, policies: dict[str, ModelPolicy], levels: Levels) -> None:
        """New bounds, knobs and levels, applied from the next request on; a new model gets its lane.
        Waiting requests of a level that no longer exists move to the least urgent one left."""
        self.bounds = bounds
        relevel = levels.count != self.levels.count
        self.levels = levels
        for name, policy in policies.items():
            if name in self._lanes:
                self._lanes[name].policy = policy
            else:
                self._lanes[name] = _ModelQueue(policy, [deque() for _ in range(levels.count)],
                                                level_samples=[0] * levels.count, passed=[0] * levels.count,
                                                seen=[-math.inf] * levels.count)
                self._order.append(name)
        if relevel:
            for lane in self._lanes.values():
                waiting = sorted((r for level in lane.levels for r in level), key=lambda r: r.received)
                lane.levels = [deque() for _ in range(levels.count)]
                lane.level_samples = [0] * levels.count
                lane.passed = [0] * levels.count
                lane.seen = [-math.inf] * levels.count
                for request in waiting:
                    request.priority = min(request.priority, levels.count - 1)
                    lane.levels[request.priority].append(request)
                    lane.level_samples[request.priority] += request.samples

    def __len__(self) -> int:
        return self._size

    def depth(self, model: str) -> int:
        """Requests waiting for `model`."""
        return len(self._lanes[model])

    def samples_ahead(self, model: str, priority: int) -> int:
        """Samples waiting for `model` at `priority` or a more urgent level: what a new request of that
        level waits behind."""
        return sum(self._lanes[model].level_samples[: priority + 1])

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
        lane.levels[request.priority].append(request)
        lane.samples += request.samples
        lane.level_samples[request.priority] += request.samples
        lane.seen[request.priority] = request.received
        self._size += 1
        self.nbytes += nbytes
        self._per_client[client] += 1
        self._bytes_per_client[client] += nbytes
        self._watch_deadline(request)
        return None

    def _watch_deadline(self, request: QueuedRequest) -> None:
        heapq.heappush(self._deadlines, (request.deadline, next(self._seq), request))
        if len(self._deadlines) > 2 * self.bounds.max_size + 1024:
            # Long deadlines of requests long gone pile up below the top (and a request put back has
            # its entry twice); rebuild with one entry per waiting request.
            waiting = {id(entry[2]): entry for entry in self._deadlines if entry[2].state == WAITING}
            self._deadlines = list(waiting.values())
            heapq.heapify(self._deadlines)

    def put_back(self, requests: list[QueuedRequest]) -> None:
        """Return taken requests to the head of their levels, in order: the dispatcher could not send them
        (they name the version their batch did not go to, whose executors are all busy). They were admitted
        once; the bounds do not refuse them now."""
        for request in reversed(requests):
            lane = self._lanes[request.header.model]
            lane.levels[request.priority].appendleft(request)
            lane.samples += request.samples
            lane.level_samples[request.priority] += request.samples
            self._size += 1
            self.nbytes += request.nbytes
            self._per_client[request.client] += 1
            self._bytes_per_client[request.client] += request.nbytes
            request.state = WAITING
            self._watch_deadline(request)

    def displace_for(self, request: QueuedRequest) -> list[QueuedRequest] | None:
        """Make room in a full queue for `request` by removing the newest waiting requests of less urgent
        levels (least urgent first); return them, or None (removing nothing) when that cannot make room.
        A connection's own bounds are never bypassed: over them, nothing is displaced."""
        bounds, client = self.bounds, request.client
        if ((bounds.max_per_client and self._per_client[client] >= bounds.max_per_client)
                or self._bytes_per_client[client] + request.nbytes > bounds.max_bytes_per_client):
            return None
        excess = max(0, self._size - bounds.max_size + 1)
        victims: list[QueuedRequest] = []
        freed = 0

        def fits() -> bool:
            return len(victims) >= excess and self.nbytes - freed + request.nbytes <= bounds.max_bytes

        for victim in self._newest_below(request.priority):
            if fits():
                break
            victims.append(victim)
            freed += victim.nbytes
        if not fits():
            return None
        for victim in victims:
            self._remove(victim, REMOVED)
        self._drop_settled_deadlines()
        return victims

    def _newest_below(self, priority: int) -> Iterator[QueuedRequest]:
        """Waiting requests less urgent than `priority`: the least urgent level first, newest first in each."""
        for index in range(self.levels.count - 1, priority, -1):
            yield from heapq.merge(*(reversed(lane.levels[index]) for lane in self._lanes.values()),
                                   key=lambda r: -r.received)

    def cancel(self, client: Hashable, request_id: RequestId) -> QueuedRequest | None:
        """Remove and return `client`'s waiting request `request_id`; None if none waits.

        A scan: cancels are rare, and an index would cost every request.
        """
        for lane in self._lanes.values():
            for level in lane.levels:
                for request in level:
                    if request.header.id == request_id and request.client == client:
                        self._remove(request, REMOVED)
                        self._drop_settled_deadlines()
                        return request
        return None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every waiting request whose deadline is at or before `now`."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if request.state != WAITING:
                continue
            self._remove(request, EXPIRED)
            expired.append(request)
        self._drop_settled_deadlines()
        return expired

    def take(self, capacity: Callable[[str], Capacity], now: float) -> tuple[str, list[QueuedRequest]] | None:
        """The next batch to send, or None when the policy says wait.

        `capacity(model)` says what the executors that can run the model can take. Lanes
        are served round-robin, so a model with a long backlog cannot starve another
        model's requests.
        """
        for step in range(len(self._order)):
            name = self._order[(self._next_lane + step) % len(self._order)]
            lane = self._lanes[name]
            if not lane.samples:
                continue
            room = capacity(name)
            if room.idle or (room.spare and self._due(name, lane, room, now)):
                self._next_lane = (self._next_lane + step + 1) % len(self._order)
                lane.go_at = None
                return name, self._pop_batch(lane)
        return None

    def next_wakeup(self, now: float) -> float | None:
        """Seconds until the policy may change its mind by itself (a batch ages, a deadline passes).

        A lane with a fixed window already full or aged is not counted: it waits for an
        executor, whose answer wakes the loop anyway.
        """
        times = []
        for lane in self._lanes.values():
            wait = lane.policy.max_wait_s
            if not lane.samples or (wait is not None and lane.samples >= lane.policy.max_batch_size):
                continue
            due = lane.go_at if wait is None else lane.oldest().received + wait
            if due is not None and due > now:
                times.append(due)
        if self._deadlines:
            times.append(self._deadlines[0][0])
        return max(0.0, min(times) - now) if times else None

    def drain(self) -> list[QueuedRequest]:
        """Remove and return every waiting request (for a forced stop)."""
        drained = [r for lane in self._lanes.values() for level in lane.levels for r in level]
        for lane in self._lanes.values():
            for level in lane.levels:
                level.clear()
            lane.samples = 0
            lane.level_samples = [0] * len(lane.levels)
        for request in drained:
            request.state = TAKEN
        self._per_client.clear()
        self._bytes_per_client.clear()
        self._size = 0
        self.nbytes = 0
        self._deadlines.clear()
        return drained

    def _due(self, name: str, lane: _ModelQueue, room: Capacity, now: float) -> bool:
        """Whether a lane's batch goes behind a running one now: with a fixed window, when it is full or
        its oldest request has waited the window; with "auto", when an executor is about to be free."""
        wait = lane.policy.max_wait_s
        if wait is not None:
            return lane.samples >= lane.policy.max_batch_size or now - lane.oldest().received >= wait
        # "auto": the batch could not start before an executor is free anyway, so it is formed just
        # before then (unless its most pressing deadline needs it sent sooner): a partial one gathers
        # company, and a full one takes in the urgent requests that come meanwhile instead of leaving
        # them to wait behind it. A full one with no more urgent traffic to expect goes at once: held,
        # it would only cost a fast model its pipelining.
        plan = self._plan(lane)
        if lane.samples >= lane.policy.max_batch_size:
            least_urgent = max(r.priority for r in plan)
            if not any(seen > now - URGENT_MEMORY_S for seen in lane.seen[:least_urgent]):
                return True
        go_at = room.free_at - AUTO_LEAD_S
        compute = self._times.batch_s(name, min(lane.samples, lane.policy.max_batch_size))
        if compute is not None:
            go_at = min(go_at, min(r.deadline for r in plan) - compute - AUTO_LEAD_S)
        lane.go_at = go_at
        return now >= go_at

    def _leader(self, lane: _ModelQueue) -> int:
        """The level that leads the next batch: one that waited through too many batches, else the most urgent."""
        patience = self.levels.patience
        waiting = [index for index, level in enumerate(lane.levels) if level]
        starved = [index for index in waiting if lane.passed[index] >= patience]
        return starved[0] if starved else waiting[0]

    def _plan(self, lane: _ModelQueue) -> list[QueuedRequest]:
        """The requests the lane's next batch takes, in order: the oldest of the leading level, then of
        each other level, most urgent first, while their samples fit in max_batch_size."""
        limit = lane.policy.max_batch_size
        batch: list[QueuedRequest] = []
        samples = 0
        leader = self._leader(lane)
        for index in (leader, *(index for index in range(len(lane.levels)) if index != leader)):
            for request in lane.levels[index]:
                # The first request always goes, even over a max_batch_size lowered (SIGHUP) since it was
                # accepted: the slot was sized for the old limit, and leaving it would jam the lane.
                if batch and samples + request.samples > limit:
                    break
                batch.append(request)
                samples += request.samples
        return batch

    def _pop_batch(self, lane: _ModelQueue) -> list[QueuedRequest]:
        batch = self._plan(lane)
        taken = [0] * len(lane.levels)
        for request in batch:  # each level's planned requests are the head of its deque, in order
            lane.levels[request.priority].popleft()
            request.state = TAKEN
            self._left(request)
            taken[request.priority] += request.samples
        for index, samples in enumerate(taken):
            waited = lane.level_samples[index] > 0
            lane.level_samples[index] -= samples
            lane.samples -= samples
            lane.passed[index] = lane.passed[index] + 1 if waited and not samples else 0
        self._drop_settled_deadlines()
        return batch

    def queued_by(self, client: Hashable) -> int:
        """Requests `client` has waiting."""
        return self._per_client[client]

    def _remove(self, request: QueuedRequest, state: int) -> None:
        lane = self._lanes[request.header.model]
        level = lane.levels[request.priority]
        if level[-1] is request:  # a displaced request is the newest: no scan
            level.pop()
        else:
            level.remove(request)
        lane.samples -= request.samples
        lane.level_samples[request.priority] -= request.samples
        self._left(request)
        request.state = state

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
