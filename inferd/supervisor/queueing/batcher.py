"""The batching policy: which waiting requests make the next batch, and when it goes.

A batch is led by the most urgent level waiting in its model's lane of the
queue (queue.py) and filled from the levels after it while its samples fit in
`max_batch_size`. No level starves: one that waited through
`1 / priority_share - 1` batches in a row without a request in them leads the
next one.

The policy is work-conserving: when an executor is idle, whatever is waiting
goes at once; a batch is queued behind a running one only when it is full, or
when its oldest request has waited `max_wait_ms`, or (the "auto" window) when
an executor is about to be free or a deadline in the batch says go. Lanes
are served round-robin, so a model's lone request never waits behind another
model's backlog.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from inferd.config.schema import Config
from inferd.supervisor.queueing.queue import Bounds, Lane, Levels, QueuedRequest, RequestQueue, Shapes

# The "auto" window sends a batch this long before its executor is expected to be free: the time to
# stack it and for the worker to pick it up, so the executor never waits for it.
AUTO_LEAD_S = 0.001  # and the loop's poll wakes on whole milliseconds
URGENT_MEMORY_S = 1.0  # a level that took a request this recently may send more: a full batch waits for them


@dataclass
class ModelPolicy:
    """The batching knobs of one model; `max_wait_s` None is the "auto" window."""

    max_batch_size: int
    max_wait_s: float | None
    by_shape: bool = False  # a request batches only with requests of its shape (ModelConfig.batches_by_shape)
    pads: bool = False  # its requests are padded to shape buckets: a smaller bucket may ride along


class Capacity(NamedTuple):
    """What the executors of a model can take now: one is idle; one can queue one more batch behind
    the one it runs; and when (monotonic) such a one is expected to be free."""

    idle: bool
    spare: bool
    free_at: float = 0.0


class BatchTimes(Protocol):
    """Expected compute seconds of a batch of a model, by its samples (None: not yet measured)."""

    def batch_s(self, model: str, samples: int, elements: int | None = None) -> float | None: ...


@dataclass
class _LanePolicy:
    """The policy's memory of one lane: its knobs, and what it decided before."""

    policy: ModelPolicy
    passed: list[int] = field(default_factory=list)  # per level: batches in a row it waited through unserved
    go_at: float | None = None  # the "auto" window: when the waiting batch goes


def queue_settings(config: Config) -> tuple[Bounds, dict[str, ModelPolicy], Levels]:
    """The queue's bounds, each model's batching knobs and the priority levels, from the config."""
    queue = config.queue
    bounds = Bounds(queue.max_size, queue.max_bytes, queue.max_per_client, queue.max_bytes_per_client)
    policies = {
        name: ModelPolicy(m.max_batch_size, None if m.max_wait_ms == "auto" else m.max_wait_ms / 1000,
                          m.batches_by_shape, m.padded and bool(m.shape_buckets))
        for name, m in config.models.items()
    }
    return bounds, policies, Levels(queue.priority_levels, queue.default_level, queue.priority_share)


def _rides_along(shapes: Shapes, bucket: Shapes) -> bool:
    """Whether samples of bucket `shapes` may be padded up to bucket `bucket`: no dim of theirs is larger, and
    none less than half as large (padding a sample to more than twice its size costs more than it saves)."""
    return all(size <= most <= size * 2
               for shape, largest in zip(shapes, bucket) for size, most in zip(shape, largest))


class _NoTimes:
    def batch_s(self, model: str, samples: int, elements: int | None = None) -> float | None:
        return None


NO_TIMES = _NoTimes()


class Batcher:
    """Turns a RequestQueue's lanes into batches, one model at a time, round-robin."""

    def __init__(self, queue: RequestQueue, policies: dict[str, ModelPolicy], times: BatchTimes = NO_TIMES) -> None:
        self.queue = queue
        self._times = times
        self._lanes: dict[str, _LanePolicy] = {}
        self._order: dict[str, int] = {}  # model -> its place in the round
        self._next_lane = 0
        self.configure(policies)

    def configure(self, policies: dict[str, ModelPolicy]) -> None:
        """New knobs, from the next batch on (after the queue took its new config); a new model gets its
        turn, and every lane's count of batches passed starts again when the number of levels changed."""
        count = self.queue.levels.count
        for name, policy in policies.items():
            if name in self._lanes:
                self._lanes[name].policy = policy
            else:
                self._lanes[name] = _LanePolicy(policy)
                self._order[name] = len(self._order)
            if len(self._lanes[name].passed) != count:
                self._lanes[name].passed = [0] * count

    def take(self, capacity: Callable[[str], Capacity], now: float) -> tuple[str, list[QueuedRequest]] | None:
        """The next batch to send, taken out of the queue, or None when the policy says wait.

        `capacity(model)` says what the executors that can run the model can take. Lanes
        are served round-robin, so a model with a long backlog cannot starve another
        model's requests.
        """
        busy = self.queue.busy
        if not busy:
            return None
        order, count = self._order, len(self._order)
        names = busy if len(busy) == 1 else sorted(busy, key=lambda n: (order[n] - self._next_lane) % count)
        for name in names:
            waiting = busy[name]
            room = capacity(name)
            lane = self._lanes[name]
            if room.idle or (room.spare and self._due(name, waiting, lane, room, now)):
                self._next_lane = (order[name] + 1) % count
                lane.go_at = None
                return name, self._take(name, waiting, lane)
        return None

    def next_wakeup(self, now: float) -> float | None:
        """Seconds until the policy may change its mind by itself (a batch ages, a deadline passes).

        A lane with a fixed window already full or aged is not counted: it waits for an
        executor, whose answer wakes the loop anyway.
        """
        times = []
        for name, waiting in self.queue.busy.items():
            lane = self._lanes[name]
            wait = lane.policy.max_wait_s
            if wait is not None and self._full(waiting, lane):
                continue
            due = lane.go_at if wait is None else waiting.oldest().received + wait
            if due is not None and due > now:
                times.append(due)
        deadline = self.queue.next_deadline()
        if deadline is not None:
            times.append(deadline)
        return max(0.0, min(times) - now) if times else None

    def _due(self, name: str, waiting: Lane, lane: _LanePolicy, room: Capacity, now: float) -> bool:
        """Whether a lane's batch goes behind a running one now: with a fixed window, when it is full or
        its oldest request has waited the window; with "auto", when an executor is about to be free."""
        wait = lane.policy.max_wait_s
        if wait is not None:
            return self._full(waiting, lane) or now - waiting.oldest().received >= wait
        # "auto": the batch could not start before an executor is free anyway, so it is formed just
        # before then (unless its most pressing deadline needs it sent sooner): a partial one gathers
        # company, and a full one takes in the urgent requests that come meanwhile instead of leaving
        # them to wait behind it. A full one with no more urgent traffic to expect goes at once: held,
        # it would only cost a fast model its pipelining.
        plan = self._plan(waiting, lane)
        if self._full(waiting, lane):
            least_urgent = max(r.priority for r in plan)
            if not any(seen > now - URGENT_MEMORY_S for seen in waiting.seen[:least_urgent]):
                return True
        go_at = room.free_at - AUTO_LEAD_S
        # Where requests batch by shape, the batch's own size (elements per sample) is known.
        elements = sum(math.prod(shape) for shape in plan[0].shapes) if lane.policy.by_shape else None
        compute = self._times.batch_s(name, min(waiting.samples, lane.policy.max_batch_size), elements)
        if compute is not None:
            go_at = min(go_at, min(r.deadline for r in plan) - compute - AUTO_LEAD_S)
        lane.go_at = go_at
        return now >= go_at

    def _full(self, waiting: Lane, lane: _LanePolicy) -> bool:
        """Whether the lane's next batch would be full."""
        limit = lane.policy.max_batch_size
        if waiting.samples < limit:
            return False
        # Requests of a model of fixed shapes all batch together; others only with their like.
        return not lane.policy.by_shape or sum(r.samples for r in self._plan(waiting, lane)) >= limit

    def _leader(self, waiting: Lane, lane: _LanePolicy) -> int:
        """The level that leads the next batch: one that waited through too many batches, else the most urgent."""
        patience = self.queue.levels.patience
        levels = [index for index, level in enumerate(waiting.levels) if level]
        starved = [index for index in levels if lane.passed[index] >= patience]
        return starved[0] if starved else levels[0]

    def _plan(self, waiting: Lane, lane: _LanePolicy) -> list[QueuedRequest]:
        """The requests the lane's next batch takes, in order: the oldest of the leading level, then of
        each other level, most urgent first, while their samples fit in max_batch_size. Where the model
        takes inputs of any size, only requests shaped like the first one (or of its shape bucket) join
        it; where they are padded to buckets, requests of a smaller bucket at least half as large also
        ride along, padded up, when the samples of their own bucket that wait could not fill a batch:
        short requests are not padded to long ones while enough of them wait to go on their own, nor
        to more than twice their size, and do not wait for company that is not coming. A longer bucket
        never joins."""
        limit, by_shape = lane.policy.max_batch_size, lane.policy.by_shape
        batch: list[QueuedRequest] = []
        samples = 0
        leader = self._leader(waiting, lane)
        by_bucket: Counter[Shapes] | None = None
        for index in (leader, *(index for index in range(len(waiting.levels)) if index != leader)):
            for request in waiting.levels[index]:
                # The first request always goes, even over a max_batch_size lowered (SIGHUP) since it was
                # accepted: the slot was sized for the old limit, and leaving it would jam the lane.
                if batch and samples + request.samples > limit:
                    break
                # (The loop turns over the plan often, on the request path: fixed shapes skip the comparison.)
                if by_shape and batch and request.shapes != batch[0].shapes:
                    if not lane.policy.pads or not _rides_along(request.shapes, batch[0].shapes):
                        continue
                    if by_bucket is None:
                        by_bucket = Counter()
                        for level in waiting.levels:
                            for each in level:
                                by_bucket[each.shapes] += each.samples
                    if by_bucket[request.shapes] >= limit:
                        continue
                batch.append(request)
                samples += request.samples
        return batch

    def _take(self, name: str, waiting: Lane, lane: _LanePolicy) -> list[QueuedRequest]:
        batch = self._plan(waiting, lane)
        waited = [samples > 0 for samples in waiting.level_samples]
        taken = self.queue.take(name, batch)
        lane.passed = [passed + 1 if was and not samples else 0
                       for passed, was, samples in zip(lane.passed, waited, taken)]
        return batch
