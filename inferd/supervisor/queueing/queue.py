"""The bounded request queue: where admitted requests wait until the batcher takes them.

Requests wait per model (a lane) and per priority level (0 the most urgent),
each level in arrival order. The queue is bounded in requests and in bytes,
over all and per connection; when it is full, an urgent request may displace
the newest one of a less urgent level. A waiting request leaves exactly once:
taken into a batch, expired (its deadline passed: answered `timeout`, never
computed), displaced or cancelled. Which requests a batch takes, and when, is
the batcher's (batcher.py). Only the supervisor's loop thread touches the
queue (the frontend puts and cancels, the loop takes and expires), so it takes
no lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from inferd.protocol import Buffer, RequestHeader, RequestId
from inferd.supervisor.shared.regions import Place, RegionSlice

# Each input's per-sample shape, for a request of a model that takes inputs of any size in some dim.
Shapes = tuple[tuple[int, ...], ...]

# A request's life in the queue; a request leaves exactly once (REMOVED: displaced, cancelled, or its model
# could not be loaded).
WAITING, TAKEN, EXPIRED, REMOVED = range(4)


def displaced_sentence(priority: int) -> str:
    """The reply's sentence for a request displaced from a full queue by one of `priority`."""
    return f"displaced by a more urgent request (priority {priority}) while the queue was full; retry later"


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
    places: tuple[Place | None, ...] = ()  # per output: where in a region to write it
    cancelled: bool = False  # its client cancelled it while its batch ran: the result is dropped
    answered: bool = False  # answered `timeout` at its deadline while its batch ran: the result is dropped
    lost_with: tuple[str, ...] = ()  # the workers that died while its batch ran (it is tried again once)
    shapes: Shapes = ()  # its samples' shape per input, where the model takes any: it batches only with its like
    grouped: bool = False  # it came in a group: its reply may leave in one with others of its batch
    displaceable: bool = True  # a more urgent request may take its place in a full queue (not a pipeline's
    # steps after the one its run was admitted at)


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


@dataclass(frozen=True)
class Bounds:
    """How much may wait: requests and bytes, over all and per connection (0 requests: no cap)."""

    max_size: int
    max_bytes: int
    max_per_client: int
    max_bytes_per_client: int


@dataclass
class Lane:
    """One model's waiting requests, a deque per level, and their sample counts."""

    levels: list[deque[QueuedRequest]]
    samples: int = 0
    level_samples: list[int] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)  # per level: when its latest request arrived

    @classmethod
    def empty(cls, count: int) -> Lane:
        """A lane with `count` empty levels."""
        return cls([deque() for _ in range(count)], level_samples=[0] * count, seen=[-math.inf] * count)

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    def oldest(self) -> QueuedRequest:
        """The request that has waited longest (the lane is not empty)."""
        return min((level[0] for level in self.levels if level), key=lambda r: r.received)


class RequestQueue:
    """A bounded queue of requests, one lane per model, one level per priority in each lane."""

    def __init__(self, bounds: Bounds, models: Iterable[str], levels: Levels = Levels()) -> None:
        self.bounds = bounds
        self.levels = levels
        self.lanes: dict[str, Lane] = {}
        # The lanes that hold requests: what the batcher and placement walk each turn of the loop, so that
        # a daemon configured with a thousand models pays for the few asked for, not for all of them.
        self.busy: dict[str, Lane] = {}
        self._per_client: Counter[Hashable] = Counter()
        self._bytes_per_client: Counter[Hashable] = Counter()
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()
        self._size = 0
        self.nbytes = 0
        self.configure(bounds, models, levels)

    def configure(self, bounds: Bounds, models: Iterable[str], levels: Levels) -> None:
        """New bounds and levels, applied from the next request on; a new model gets its lane. Waiting
        requests of a level that no longer exists move to the least urgent one left."""
        self.bounds = bounds
        relevel = levels.count != self.levels.count
        self.levels = levels
        for name in models:
            self.lanes.setdefault(name, Lane.empty(levels.count))
        if relevel:
            for lane in self.lanes.values():
                waiting = sorted((r for level in lane.levels for r in level), key=lambda r: r.received)
                fresh = Lane.empty(levels.count)
                lane.levels, lane.level_samples, lane.seen = fresh.levels, fresh.level_samples, fresh.seen
                for request in waiting:
                    request.priority = min(request.priority, levels.count - 1)
                    lane.levels[request.priority].append(request)
                    lane.level_samples[request.priority] += request.samples

    def __len__(self) -> int:
        return self._size

    def depth(self, model: str) -> int:
        """Requests waiting for `model`."""
        return len(self.lanes[model])

    def samples_ahead(self, model: str, priority: int) -> int:
        """Samples waiting for `model` at `priority` or a more urgent level: what a new request of that
        level waits behind."""
        return sum(self.lanes[model].level_samples[: priority + 1])

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

    def refusal_sentence(self, refusal: Refusal) -> str:
        """Why put() refused a request, as its reply says."""
        bounds = self.bounds
        return {
            Refusal.FULL: f"the queue is full ({bounds.max_size} requests); retry later",
            Refusal.BYTES: f"the queue holds {self.nbytes} bytes of requests and this one would pass queue.max_bytes "
                           f"({bounds.max_bytes}); retry later",
            Refusal.CLIENT_FULL: f"this connection already has {bounds.max_per_client} requests waiting "
                                 "(queue.max_per_client); retry later",
            Refusal.CLIENT_BYTES: "this connection's waiting requests would pass queue.max_bytes_per_client "
                                  f"({bounds.max_bytes_per_client} bytes); retry later",
        }[refusal]

    def put(self, request: QueuedRequest) -> Refusal | None:
        """Enqueue, or (changing nothing) say why not."""
        bounds, client, nbytes = self.bounds, request.client, request.nbytes
        # The bounds in one expression: this runs for every request.
        if (self._size >= bounds.max_size or self.nbytes + nbytes > bounds.max_bytes
                or (bounds.max_per_client and self._per_client[client] >= bounds.max_per_client)
                or self._bytes_per_client[client] + nbytes > bounds.max_bytes_per_client):
            return self.refusal(client, nbytes)
        model = request.header.model
        lane = self.lanes[model]
        lane.levels[request.priority].append(request)
        if not lane.samples:
            self.busy[model] = lane
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
        once; the bounds do not refuse them now. A request of a level that a SIGHUP removed since it was
        taken goes to the least urgent level left, as a waiting one did."""
        for request in reversed(requests):
            request.priority = min(request.priority, self.levels.count - 1)
            model = request.header.model
            lane = self.lanes[model]
            lane.levels[request.priority].appendleft(request)
            if not lane.samples:
                self.busy[model] = lane
            lane.samples += request.samples
            lane.level_samples[request.priority] += request.samples
            self._size += 1
            self.nbytes += request.nbytes
            self._per_client[request.client] += 1
            self._bytes_per_client[request.client] += request.nbytes
            request.state = WAITING
            self._watch_deadline(request)

    def take(self, model: str, batch: list[QueuedRequest]) -> list[int]:
        """Take `batch` out of `model`'s lane: the requests at the head of each level, in order (what the
        batcher planned), but for those it passed over as shaped unlike the batch. Returns the samples
        taken from each level."""
        lane = self.lanes[model]
        taken = [0] * len(lane.levels)
        for request in batch:
            level = lane.levels[request.priority]
            if level[0] is request:
                level.popleft()
            else:
                level.remove(request)
            request.state = TAKEN
            self._left(request)
            taken[request.priority] += request.samples
        for index, samples in enumerate(taken):
            lane.level_samples[index] -= samples
            lane.samples -= samples
        if not lane.samples:
            del self.busy[model]
        self._drop_settled_deadlines()
        return taken

    def admit(self, request: QueuedRequest) -> tuple[Refusal | None, list[QueuedRequest]]:
        """Put `request` in, where a full queue (of requests, or of bytes) makes room by displacing less urgent
        ones: why it was refused (None: it waits now), and the requests displaced for it, which the caller
        answers `overloaded` (displaced_sentence)."""
        refused = self.put(request)
        if refused not in (Refusal.FULL, Refusal.BYTES):
            return refused, []
        displaced = self.displace_for(request)
        if displaced is None:
            return refused, []
        return self.put(request), displaced

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
        """Waiting requests less urgent than `priority` that may be displaced: the least urgent level first,
        newest first in each."""
        for index in range(self.levels.count - 1, priority, -1):
            yield from (request for request in heapq.merge(*(reversed(lane.levels[index])
                                                              for lane in self.busy.values()),
                                                            key=lambda r: -r.received) if request.displaceable)

    def cancel(self, client: Hashable, request_id: RequestId) -> QueuedRequest | None:
        """Remove and return `client`'s waiting request `request_id`; None if none waits.

        A scan: cancels are rare, and an index would cost every request.
        """
        for lane in self.busy.values():  # left at the first match: its removal cannot upset the walk
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

    def next_deadline(self) -> float | None:
        """The soonest deadline of a waiting request (monotonic), if any waits."""
        return self._deadlines[0][0] if self._deadlines else None

    def withdraw(self, request: QueuedRequest) -> None:
        """Remove `request` itself, which waits here (not another of its client's with its id: a client may
        have several in flight under one id)."""
        self._remove(request, REMOVED)
        self._drop_settled_deadlines()

    def remove_model(self, model: str) -> list[QueuedRequest]:
        """Remove and return every request waiting for `model` (nothing can compute them)."""
        removed = [r for level in self.lanes[model].levels for r in level]
        for request in removed:
            self._remove(request, REMOVED)
        self._drop_settled_deadlines()
        return removed

    def drain(self) -> list[QueuedRequest]:
        """Remove and return every waiting request (for a forced stop)."""
        drained = [r for lane in self.lanes.values() for level in lane.levels for r in level]
        for lane in self.lanes.values():
            for level in lane.levels:
                level.clear()
            lane.samples = 0
            lane.level_samples = [0] * len(lane.levels)
        self.busy.clear()
        for request in drained:
            request.state = TAKEN
        self._per_client.clear()
        self._bytes_per_client.clear()
        self._size = 0
        self.nbytes = 0
        self._deadlines.clear()
        return drained

    def queued_by(self, client: Hashable) -> int:
        """Requests `client` has waiting."""
        return self._per_client[client]

    def _remove(self, request: QueuedRequest, state: int) -> None:
        model = request.header.model
        lane = self.lanes[model]
        level = lane.levels[request.priority]
        if level[-1] is request:  # a displaced request is the newest: no scan
            level.pop()
        else:
            level.remove(request)
        lane.samples -= request.samples
        lane.level_samples[request.priority] -= request.samples
        if not lane.samples:
            del self.busy[model]
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
