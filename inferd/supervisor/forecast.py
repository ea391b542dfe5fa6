"""What the daemon expects of the near future: how long a batch computes, and when a new request
would finish.

Compute times are learned from the batches that ran (the dispatcher is their one
writer), per model, per batch-size band and, for a model with inputs of any size,
per band of its samples' size (elements); the batcher's "auto" window and
deadline-aware admission read them. The finish estimate leans optimistic (what
waits ahead is assumed to run in full batches spread over every executor, with
nothing cancelled or expired ahead of it counted out), so that a request it
refuses would very likely have missed its deadline.
"""

from __future__ import annotations

import math

from inferd.supervisor.live import LiveVersions
from inferd.supervisor.queue import RequestQueue
from inferd.supervisor.workers import PIPELINE_DEPTH, WorkerTable

SMOOTHING = 0.2  # weight of the newest batch in a band's average: a few batches follow a change


class ComputeTimes:
    """Expected compute seconds of a batch, per model and per power-of-two band of its samples (and of the
    elements of each of its samples, where they vary), for the version that computed last (a new live
    version starts afresh: it computes at its own speed)."""

    def __init__(self) -> None:
        self._bands: dict[str, dict[tuple[int, int], float]] = {}
        self._least: dict[str, int] = {}  # model -> the smallest elements band measured
        self._versions: dict[str, str] = {}

    def observe(self, model: str, version: str, samples: int, seconds: float, elements: int | None = None) -> None:
        """A batch of `samples` samples (of `elements` input elements each, where that varies) of `version` of
        `model` computed in `seconds`."""
        if self._versions.get(model) != version:
            self._versions[model] = version
            self._bands[model] = {}
            self._least.pop(model, None)
        bands = self._bands[model]
        band = (samples.bit_length(), (elements or 0).bit_length())
        self._least[model] = min(band[1], self._least.get(model, band[1]))
        known = bands.get(band)
        bands[band] = seconds if known is None else known + SMOOTHING * (seconds - known)

    def batch_s(self, model: str, samples: int, elements: int | None = None) -> float | None:
        """Expected seconds for a batch of `samples` samples of `elements` elements each (None: the smallest
        measured); a band not yet measured takes the nearest smaller one measured (a batch computes no
        faster with more or larger samples), else None."""
        bands = self._bands.get(model)
        if not bands:
            return None
        band = samples.bit_length()
        size = elements.bit_length() if elements is not None else self._least[model]
        known = bands.get((band, size))
        if known is not None:  # the common case, for every request's admission: no scan
            return known
        smaller = [(e, s) for s, e in bands if s <= band and e <= size]
        if not smaller:
            return None
        e, s = max(smaller)
        return bands[(s, e)]


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
