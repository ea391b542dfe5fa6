"""Measurements of the daemon, cheap enough for every request.

Everything here is updated by the supervisor's loop thread only, so no lock is
taken on the hot path. Latencies go into fixed log-spaced histograms (memory
does not grow with traffic). Each (model, version) keeps one series since
start and one per 5-second window in a ring of 13, from which "the last 10 s"
and "the last minute" are merged when someone asks.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

WINDOW_S = 5.0
WINDOWS = 13  # 60 s of full windows, plus the one filling now

# Histogram bounds in seconds: 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9 per decade, 10 us to 100 s.
_STEPS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)
BOUNDS: tuple[float, ...] = (
    *(round(step * 10.0**exponent, 12) for exponent in range(-5, 2) for step in _STEPS), 100.0,
)
# The subset exported as Prometheus buckets: 1, 2.5, 5 per decade.
PROMETHEUS_BOUNDS: tuple[float, ...] = tuple(
    b for b in BOUNDS if round(b / 10 ** math.floor(math.log10(b)), 6) in (1, 2.5, 5)
)
BATCH_BOUNDS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    """Counts of values per bucket of BOUNDS (the last bucket is everything above), with sum and max."""

    __slots__ = ("count", "counts", "max", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def add(self, value: float, times: int = 1) -> None:
        """Count `value` (seconds) `times` times."""
        self.counts[bisect.bisect_left(BOUNDS, value)] += times
        self.count += times
        self.sum += value * times
        if value > self.max:
            self.max = value

    def add_all(self, values: Sequence[float]) -> None:
        """Count each of `values` (seconds) once."""
        counts, bisect_left = self.counts, bisect.bisect_left
        for value in values:
            counts[bisect_left(BOUNDS, value)] += 1
        if values:
            self.count += len(values)
            self.sum += sum(values)
            self.max = max(self.max, *values)

    def merge(self, other: Histogram) -> None:
        """Add every count of `other` to this one."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.count += other.count
        self.sum += other.sum
        self.max = max(self.max, other.max)

    def quantile(self, q: float) -> float:
        """The value below which a fraction `q` of the counted values fall, interpolated in its bucket."""
        if self.count == 0:
            return 0.0
        rank = q * self.count
        seen = 0
        for index, n in enumerate(self.counts):
            if n and seen + n >= rank:
                low = BOUNDS[index - 1] if index > 0 else 0.0
                high = BOUNDS[index] if index < len(BOUNDS) else self.max
                return min(self.max, low + (high - low) * (rank - seen) / n)
            seen += n
        return self.max

    def summary_ms(self) -> dict[str, float]:
        """p50/p90/p99/max in milliseconds, and how many values they rest on."""
        return {
            "count": self.count,
            "p50": round(self.quantile(0.50) * 1000, 3),
            "p90": round(self.quantile(0.90) * 1000, 3),
            "p99": round(self.quantile(0.99) * 1000, 3),
            "max": round(self.max * 1000, 3),
        }

    def cumulative(self, bounds: tuple[float, ...]) -> list[tuple[float, int]]:
        """(upper bound, count of values at or below it) for each of `bounds` (a subset of BOUNDS), then +Inf."""
        out, running, index = [], 0, 0
        for bound in bounds:
            while index < len(BOUNDS) and BOUNDS[index] <= bound:
                running += self.counts[index]
                index += 1
            out.append((bound, running))
        out.append((math.inf, self.count))
        return out


@dataclass
class Series:
    """What happened to one (model, version) over some span of time."""

    replies: Counter = field(default_factory=Counter)  # status -> requests
    samples: int = 0  # samples answered `ok`
    good: int = 0  # requests answered `ok` (within their deadline, as every `ok` is): the goodput
    total: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    compute: Histogram = field(default_factory=Histogram)
    batch_sizes: Counter = field(default_factory=Counter)  # samples per batch -> batches
    # Seconds of the batches' phases (inputs in, forward, outputs out), counted once per `ok` request...
    phases: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # ... and once per batch, by how many samples it computed: [batches, inputs, forward, outputs].
    computed: dict[int, list[float]] = field(default_factory=dict)
    queue_peak: int = 0
    last_answered: float = 0.0  # when its last ok reply went (monotonic; 0: none yet)

    def merge(self, other: Series) -> None:
        """Fold `other` into this series."""
        self.replies.update(other.replies)
        self.samples += other.samples
        self.good += other.good
        self.total.merge(other.total)
        self.queue.merge(other.queue)
        self.compute.merge(other.compute)
        self.batch_sizes.update(other.batch_sizes)
        self.phases = [a + b for a, b in zip(self.phases, other.phases)]
        for size, sums in other.computed.items():
            mine = self.computed.setdefault(size, [0.0] * 4)
            self.computed[size] = [a + b for a, b in zip(mine, sums)]
        self.queue_peak = max(self.queue_peak, other.queue_peak)
        self.last_answered = max(self.last_answered, other.last_answered)


@dataclass
class LevelSeries:
    """What happened to the requests of one priority level of one model since start."""

    replies: Counter = field(default_factory=Counter)  # status -> requests
    total: Histogram = field(default_factory=Histogram)  # latency of those answered `ok`


@dataclass
class ShadowSeries:
    """The shadow trials of one candidate version of one model, since start."""

    chosen: int = 0  # requests picked to be computed again by the candidate
    compared: int = 0  # ... and compared with the live version's outputs
    allclose: int = 0  # ... whose outputs were all allclose to the live ones
    failed: int = 0  # requests of shadow batches the candidate failed on
    dropped: Counter = field(default_factory=Counter)  # why -> requests never computed by the candidate
    mismatched: int = 0  # compared requests whose outputs differ in count, dtype or shape
    max_abs: float = 0.0  # the largest difference seen among the rest
    max_rel: float = 0.0
    live_compute: Histogram = field(default_factory=Histogram)  # per batch, for the batches both computed
    shadow_compute: Histogram = field(default_factory=Histogram)


@dataclass
class StepSeries:
    """One step of a pipeline since start: per step request computed, its wait in its model's queue and its
    batch's compute time."""

    wait: Histogram = field(default_factory=Histogram)
    compute: Histogram = field(default_factory=Histogram)


@dataclass
class PipelineSeries:
    """One pipeline since start: its replies by status, the latency of those answered `ok`, and each step's
    wait and compute (by step name, in the pipeline's order)."""

    replies: Counter = field(default_factory=Counter)
    total: Histogram = field(default_factory=Histogram)
    steps: dict[str, StepSeries] = field(default_factory=dict)
    # Of the requests answered `ok`: their samples, their time in their steps' queues and batches, summed, and
    # when the last was answered (time.monotonic()), which the Open Inference Protocol's statistics give.
    samples: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0
    last_answered: float = 0.0

    def step(self, name: str) -> StepSeries:
        """The series of step `name`."""
        series = self.steps.get(name)
        if series is None:
            series = self.steps[name] = StepSeries()
        return series


@dataclass
class _Window:
    start: float
    series: dict[tuple[str, str], Series] = field(default_factory=dict)


@dataclass
class LoadSeries:
    """An on-demand model's loads and unloads since start, and the requests that waited for a load."""

    loads: int = 0
    failed: int = 0
    unloads: int = 0
    load_time: Histogram = field(default_factory=Histogram)  # asked to loaded, seconds
    waited: Histogram = field(default_factory=Histogram)  # per request that waited for a load: how long


class Stats:
    """Every measurement of the requests and batches, since start and over the last minute."""

    def __init__(self, now: float) -> None:
        self.started = now
        # Every reply to a client since start by status, with or without a model: a pipeline's request once, not
        # its steps' requests too (those count in their models' series).
        self.replies: Counter[str] = Counter()
        # (model, protocol, status) -> replies since start, for the requests that came through the gateway;
        # the rest came over ZeroMQ.
        self.by_protocol: Counter[tuple[str | None, str, str]] = Counter()
        self.undelivered = 0  # replies whose client had gone or stopped reading
        self.since_start: dict[tuple[str, str], Series] = {}
        self.levels: dict[tuple[str, int], LevelSeries] = {}  # (model, priority level) -> since start
        self.deadline_refusals: Counter[str] = Counter()  # model -> requests refused as sure to miss
        self.shadow: dict[tuple[str, str], ShadowSeries] = {}  # (model, candidate version) -> its trial
        # (model, shape) -> [batches, elements the requests brought, elements of padding], since start: for a
        # model with inputs of any size, by the per-sample shape of its batches' first input ("2x48").
        self.shapes: dict[tuple[str, str], list[int]] = {}
        self.loading: dict[str, LoadSeries] = {}  # on-demand model -> its loads
        self.pipelines: dict[str, PipelineSeries] = {}  # pipeline -> its requests and steps, since start
        self._windows: deque[_Window] = deque([_Window(now)], maxlen=WINDOWS)

    def _series(self, now: float, model: str, version: str) -> tuple[Series, Series]:
        window = self._windows[-1]
        if now - window.start >= WINDOW_S:
            window = _Window(now)
            self._windows.append(window)
        key = (model, version)
        recent = window.series.get(key)
        if recent is None:
            recent = window.series[key] = Series()
        total = self.since_start.get(key)
        if total is None:
            total = self.since_start[key] = Series()
        return recent, total

    def shadow_series(self, model: str, version: str) -> ShadowSeries:
        """The shadow record of candidate `version` of `model`."""
        series = self.shadow.get((model, version))
        if series is None:
            series = self.shadow[(model, version)] = ShadowSeries()
        return series

    def load_series(self, model: str) -> LoadSeries:
        """The load record of on-demand `model`."""
        series = self.loading.get(model)
        if series is None:
            series = self.loading[model] = LoadSeries()
        return series

    def pipeline(self, name: str) -> PipelineSeries:
        """The record of pipeline `name`."""
        series = self.pipelines.get(name)
        if series is None:
            series = self.pipelines[name] = PipelineSeries()
        return series

    def new_window(self, now: float) -> None:
        """Start a new window now (a trial begins: its guard judges only what came after)."""
        if self._windows[-1].start < now:
            self._windows.append(_Window(now))

    def _level(self, model: str, priority: int) -> LevelSeries:
        level = self.levels.get((model, priority))
        if level is None:
            level = self.levels[(model, priority)] = LevelSeries()
        return level

    def reply(self, now: float, model: str | None, version: str | None, status: str,
              protocol: str | None = None, priority: int | None = None, step: bool = False) -> None:
        """Count a reply other than `ok` (those come through `answered`); against its model and version
        when it has them (a request for an unknown model has neither), its gateway protocol if any, and
        its priority level once it has one. A pipeline `step`'s is no reply to a client: it counts against
        its model alone."""
        if not step:
            self.replies[status] += 1
        if protocol is not None:
            self.by_protocol[(model, protocol, status)] += 1
        if model is not None and version is not None:
            for series in self._series(now, model, version):
                series.replies[status] += 1
            if priority is not None:
                self._level(model, priority).replies[status] += 1

    def answered(self, now: float, model: str, version: str, samples: int,
                 totals_s: Sequence[float], queues_s: Sequence[float], compute_s: float,
                 priorities: Sequence[int], phases_s: Sequence[float] = (0.0, 0.0, 0.0), steps: int = 0) -> None:
        """Count the `ok` replies of one batch: its samples, each request's total and queue
        latency and priority level, the batch's compute time (and its phases) once per request and
        once per batch. Each is goodput: no `ok` leaves after its deadline. `steps` of them were pipelines'
        step requests, whose answers go on to their pipelines, not to clients."""
        self.replies["ok"] += len(totals_s) - steps
        requests = len(totals_s)
        for series in self._series(now, model, version):
            if requests:
                series.phases = [sum_s + phase_s * requests for sum_s, phase_s in zip(series.phases, phases_s)]
                batch = series.computed.setdefault(samples, [0.0] * 4)
                batch[0] += 1
                for index, phase_s in enumerate(phases_s, 1):
                    batch[index] += phase_s
            series.replies["ok"] += len(totals_s)
            series.samples += samples
            series.good += requests
            series.total.add_all(totals_s)
            series.queue.add_all(queues_s)
            series.compute.add(compute_s, len(totals_s))
            series.last_answered = now
        first = priorities[0] if priorities else 0
        if all(priority == first for priority in priorities):  # the usual batch: one level
            level = self._level(model, first)
            level.replies["ok"] += len(totals_s)
            level.total.add_all(totals_s)
            return
        for priority, total_s in zip(priorities, totals_s):
            level = self._level(model, priority)
            level.replies["ok"] += 1
            level.total.add(total_s)

    def batch(self, now: float, model: str, version: str, samples: int) -> None:
        """Count a batch of `samples` samples."""
        for series in self._series(now, model, version):
            series.batch_sizes[samples] += 1

    def shaped_batch(self, model: str, shape: str, real: int, padding: int) -> None:
        """Count a batch of a model with inputs of any size: its shape, and its elements real and padded."""
        counts = self.shapes.setdefault((model, shape), [0, 0, 0])
        counts[0] += 1
        counts[1] += real
        counts[2] += padding

    def queue_depth(self, now: float, model: str, version: str, depth: int) -> None:
        """Note a queue depth, for its peak."""
        for series in self._series(now, model, version):
            if depth > series.queue_peak:
                series.queue_peak = depth

    def recent(self, now: float, seconds: float) -> tuple[dict[tuple[str, str], Series], float]:
        """Series merged over the windows that started in the last `seconds`, and the span they cover."""
        merged: dict[tuple[str, str], Series] = {}
        oldest = now
        for window in self._windows:
            if window.start < now - seconds:
                continue
            oldest = min(oldest, window.start)
            for key, series in window.series.items():
                merged.setdefault(key, Series()).merge(series)
        return merged, max(now - oldest, 1e-9)
