"""What the daemon expects of the near future: when a new request would finish, from the compute times
the batches that ran took (compute_times.py). The estimate leans optimistic (what waits ahead is assumed to
run in full batches spread over every executor, with nothing cancelled or expired ahead of it counted out),
so that a request it refuses would very likely have missed its deadline.
"""

from __future__ import annotations

import math

from inferd.supervisor.dispatch.compute_times import ComputeTimes
from inferd.supervisor.processes.workers import PIPELINE_DEPTH, WorkerTable
from inferd.supervisor.queueing.queue import RequestQueue
from inferd.supervisor.shared.live import LiveVersions


class Forecast:
    """When a new request would finish, from compute times, what waits ahead of it and the executors."""

    def __init__(self, times: ComputeTimes, queue: RequestQueue, workers: WorkerTable, live: LiveVersions) -> None:
        self.times = times
        self._queue = queue
        self._workers = workers
        self._live = live

    def too_late(self, model: str, max_batch: int, priority: int, samples: int, timeout_s: float,
                 now: float, elements: int | None = None) -> float | None:
        """The finish estimate of a new request (see finish_in) when it passes `timeout_s`; None when the
        request can make it, or nothing is known.

        This runs for every request, so a quick test that takes no look at the executors comes first: a
        deadline further off than the work waiting plus PIPELINE_DEPTH full batches on every executor is
        met by any estimate but one of another model's longer batches, which this lets pass.
        """
        full = self.times.batch_s(model, max_batch)
        if full is None:
            return None
        waiting = self._queue.samples_ahead(model, priority) + samples
        if timeout_s > (PIPELINE_DEPTH + 1 + waiting / max_batch) * full:
            return None
        estimate = self.finish_in(model, max_batch, priority, samples, now, elements)
        return estimate if estimate is not None and estimate > timeout_s else None

    def finish_in(self, model: str, max_batch: int, priority: int, samples: int, now: float,
                  elements: int | None = None) -> float | None:
        """Seconds from `now` until a new request of `samples` samples (of `elements` elements each, where
        that varies) at `priority` would be answered, at the soonest; None while its model's compute time
        is not known.

        The samples waiting at its level or a more urgent one go first, in full batches of the smallest
        samples measured spread over the model's executors, once the soonest of them is free.
        """
        full = self.times.batch_s(model, max_batch)
        version = self._live.get(model)
        if full is None or version is None:
            return None
        executors = self._workers.executors_serving(model, version)
        if not executors:
            return None
        ahead = self._queue.samples_ahead(model, priority) + samples
        batches = math.ceil(ahead / max_batch)
        waves = math.ceil(batches / len(executors))
        last = self.times.batch_s(model, ahead - (batches - 1) * max_batch, elements) or 0.0
        free_in = max(0.0, min(e.free_at() for e in executors) - now)
        return free_in + (waves - 1) * full + last
