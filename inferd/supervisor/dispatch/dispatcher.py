"""The dispatcher: batches into arena slots and out to executors, results back to replies.

A batch is stacked once, straight from the received frames into a free slot of
the chosen worker's arena (laid out as ipc/slots.py says); the worker gets only
a descriptor. When it answers, replies.py sends each request its rows of every
output, and the slot is free again once they have left. A request the worker
did not compute because its deadline had passed is answered `timeout`; a batch
whose worker fails is answered `internal`, request by request, and a request
that raised when its batch was run again one request at a time gets its own
error. Every reply names the version that handled it.

While a model has a candidate under trial (candidates.py), each batch is routed
by its Split: a canary's share goes to the candidate, whole; a shadow's share is
copied when the live version has answered it and computed again by the
candidate on idle executor time (shadow.py), only to be compared.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Hashable, Sequence

import zmq

from inferd import protocol
from inferd.config.schema import Config, ModelConfig
from inferd.errors import InvalidRequest
from inferd.ipc.messages import BatchDone, BatchFailed, RunBatch, TensorRef, TensorSpec
from inferd.ipc.slots import align_up, place
from inferd.models import unpad
from inferd.supervisor.dispatch.batch import Batch
from inferd.supervisor.dispatch.compute_times import ComputeTimes
from inferd.supervisor.dispatch.replies import CANCELLED_ERROR, Replies
from inferd.supervisor.dispatch.shadow import MAX_AGE_S, ShadowJob, ShadowQueue, compare
from inferd.supervisor.processes.workers import PIPELINE_DEPTH, ExecutorHandle, WorkerHandle, WorkerState, WorkerTable
from inferd.supervisor.queueing import padding
from inferd.supervisor.queueing.batcher import Capacity
from inferd.supervisor.queueing.queue import QueuedRequest
from inferd.supervisor.shared.backstop import failure
from inferd.supervisor.shared.candidates import Candidate, Candidates, Mode, Split
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.regions import RegionSlice
from inferd.supervisor.shared.stats import Stats

log = logging.getLogger("inferd.dispatch")

SLOW_FACTOR = 5  # a batch this many times its model's median compute time gets a warning
SLOW_MIN_COUNT = 50  # ... once the median rests on this many measurements
SLOW_WARN_EVERY_S = 10.0
# ... and took at least this long: a batch of a few ms is never worth a line, however many medians it is
# (on an idle CPU a cold cache makes a 1 ms batch 3 ms).
SLOW_MIN_S = 0.05


class SlotOverflow(Exception):
    """A batch's inputs would run past the end of its slot."""


class UnreadableInput(Exception):
    """An input of one request of the batch could not be read from its client's region."""

    def __init__(self, request: QueuedRequest, error: InvalidRequest) -> None:
        super().__init__(error.message)
        self.request = request
        self.error = error


class Dispatcher:
    """Sends batches to executors and hands their answers to the replies."""

    def __init__(self, config: Config, workers: WorkerTable, replies: Replies, live: LiveVersions,
                 candidates: Candidates, stats: Stats, times: ComputeTimes) -> None:
        self.config = config
        self.candidates = candidates
        self.shadow_jobs = ShadowQueue()
        self._running_shadow_jobs: set[ExecutorHandle] = set()  # executors running a shadow batch
        self._splits: dict[str, Split] = {}
        self.times = times
        self.workers = workers
        self.replies = replies
        self.live = live
        self.stats = stats
        self.inflight: dict[int, Batch] = {}
        self.sending: list[tuple[WorkerHandle, int, list[zmq.MessageTracker]]] = []
        self._medians: dict[tuple[str, str], tuple[int, float]] = {}
        self._slow_warned: dict[str, float] = {}
        self._ids = itertools.count(1)

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): the models' inputs as they are now."""
        self.config = config

    def capacity(self, model: str) -> Capacity:
        """What the executors of `model`'s live version can take now."""
        idle = spare = False
        free_at = math.inf
        for executor in self.workers.executors_serving(model, self.live[model]):
            if executor.inflight < PIPELINE_DEPTH and executor.worker.slots.free:
                idle = idle or executor.inflight == 0
                spare = True
                free_at = min(free_at, executor.free_at())
        return Capacity(idle, spare, free_at)

    def dispatch(self, model: str, requests: list[QueuedRequest]) -> list[QueuedRequest]:
        """Copy `requests` into a slot of the least busy executor of their version and send it there.

        Returns the requests to put back in the queue: during a canary, those that name the version
        the batch did not go to, when every executor of theirs is busy; those of a model of BYTES inputs
        that did not fit the slot beside the others; and those of a batch whose executor could not be reached
        (its process is gone, which the loop has not heard yet).
        """
        candidate = self.candidates.get(model)
        if candidate is None:
            version = self.live[model]
            requests = self._keep_version(requests, model, version)
            return self._send(model, version, requests, False, time.monotonic()) if requests else []
        left: list[QueuedRequest] = []
        for index, (version, group, copy_for_shadow) in enumerate(self._route(model, requests, candidate)):
            if not group:
                continue
            if index and self.workers.executors_serving(model, version) and self._pick_executor(model, version) is None:
                left += group  # the part the batch did not go to waits for an executor of its version
            else:
                left += self._send(model, version, group, copy_for_shadow, time.monotonic())
        return left

    def _route(self, model: str, requests: list[QueuedRequest],
               candidate: Candidate) -> list[tuple[str, list[QueuedRequest], bool]]:
        """(version, its requests, whether to shadow them) for each part of a batch, the chosen part first."""
        live = self.live[model]
        split = self._splits.get(model)
        if split is None or split.candidate is not candidate:  # a new trial, or a new weight
            split = self._splits[model] = Split(candidate)
        if candidate.mode == Mode.SHADOW:
            kept = self._keep_version(requests, model, live)
            serving = bool(self.workers.executors_serving(model, candidate.version))
            return [(live, kept, serving and split.take(sum(r.samples for r in kept)))]
        canary = candidate.version
        free = [r for r in requests if r.header.version is None]
        # Only to a canary executor with room: a busy one (a worker still loading the canary has
        # none) sends the batch to the live version, uncounted: made up later, it would come as a
        # burst of canary traffic once the canary is back (after a restart, seconds of it).
        chosen = live
        if free and self._pick_executor(model, canary) is not None and split.take(sum(r.samples for r in free)):
            chosen = canary
        groups: dict[str, list[QueuedRequest]] = {chosen: [], canary if chosen == live else live: []}
        for request in requests:
            named = request.header.version
            if named is None:
                groups[chosen].append(request)
            elif named in groups:
                groups[named].append(request)
            else:
                self.replies.error(request, protocol.UNAVAILABLE, f"version {named!r} of {model} is neither "
                                   f"live ({live!r}) nor its canary ({canary!r}) any more", live)
        return [(version, group, False) for version, group in groups.items()]

    def _send(self, model: str, version: str, requests: list[QueuedRequest], copy_for_shadow: bool,
              now: float) -> list[QueuedRequest]:
        """Stack `requests` into a slot of an executor of `version` and send it the batch; the requests to put
        back in the queue (those left for a later batch, or all where the executor's process is gone)."""
        executor = self._pick_executor(model, version)
        if executor is None:
            for request in requests:
                self.replies.error(request, protocol.UNAVAILABLE, f"no worker is ready to run {version}")
            return []
        requests = self._in_time(model, requests, executor, now)
        worker = executor.worker
        requests, left = self._fitting(model, version, requests, worker.slots.slot_size)
        if not requests:
            return left
        slot = worker.slots.acquire()
        if slot is None:  # cannot happen while slots = executors x depth; never lose requests if it does
            for request in requests:
                self.replies.error(request, protocol.INTERNAL, "no free arena slot")
            return left
        batch = Batch(next(self._ids), model, version, requests, executor, slot, now, 0,
                      cuts=self._cuts(model, version), copy_for_shadow=copy_for_shadow)
        while True:
            try:
                message = self._stack(batch, worker)
                break
            except SlotOverflow:  # the load-time slot checks make this unreachable; never write past a slot
                worker.slots.release(slot)
                self.replies.failed(batch, "the batch does not fit an arena slot")
                return left
            except UnreadableInput as exc:  # that request alone is answered; the rest are stacked again
                self.replies.error(exc.request, protocol.INVALID, exc.error.message)
                requests.remove(exc.request)
                if not requests:
                    worker.slots.release(slot)
                    return left
        if not self.workers.send(executor.identity, message):
            # Nothing of it ran: it waits for another executor (or this one's replacement).
            worker.slots.release(slot)
            self.workers.unreachable(executor)
            log.warning("%s cannot be reached; %s goes back to the queue", worker.name, batch.describe())
            return [*requests, *left]
        batch.inputs = message.inputs
        if self.config.models[model].variable:
            self._count_shape(batch)
            batch.elements = sum(math.prod(ref.shape[1:]) for ref in batch.inputs)
        batch.samples = samples = sum(r.samples for r in requests)
        batch.deadline = min(r.deadline for r in requests)
        self.workers.batch_sent(executor, len(requests), now,
                                self.times.batch_s(model, samples, batch.elements) or 0.0)
        self.inflight[batch.id] = batch
        self.workers.model_used(worker, model, now)
        self.stats.batch(now, model, version, samples)
        return left

    def _fitting(self, model: str, version: str, requests: list[QueuedRequest],
                 slot_size: int) -> tuple[list[QueuedRequest], list[QueuedRequest]]:
        """Of a batch of a model with BYTES inputs, whose size its elements say, the requests whose tensors fit
        one slot together (in order), and those left for a later batch; a request that fits no slot alone is
        answered `invalid`. (The size of a batch of numeric tensors is checked once, at load: a full one fits.)"""
        spec = self.config.models[model]
        if not spec.takes_bytes:
            return requests, []
        outputs = self.workers.signature(model, version) or ()
        fitting: list[QueuedRequest] = []
        used = 0
        for index, request in enumerate(requests):
            need = slot_need(spec, outputs, request)
            if need > slot_size:
                self.replies.error(request, protocol.INVALID, f"the request's tensors take about {need} bytes of "
                                   f"an arena slot of {slot_size} (workers.shm_mb); send fewer samples or shorter "
                                   "elements, or raise workers.shm_mb")
                continue
            if used + need > slot_size:
                return fitting, requests[index:]
            fitting.append(request)
            used += need
        return fitting, []

    def _in_time(self, model: str, requests: list[QueuedRequest], executor: ExecutorHandle,
                 now: float) -> list[QueuedRequest]:
        """The requests that can finish before their deadline on `executor`, by the batch's known compute time;
        the others are answered `timeout` now, rather than computed for nobody."""
        expected = self.times.batch_s(model, sum(r.samples for r in requests), self._elements(model, requests))
        if expected is None:
            return requests
        finish = max(now, executor.free_at()) + expected
        if all(r.deadline >= finish for r in requests):
            return requests
        kept = []
        for request in requests:
            if request.deadline >= finish:
                kept.append(request)
            else:
                self.replies.error(request, protocol.TIMEOUT, (
                    f"the request would finish after its deadline ({(request.deadline - now) * 1000:.1f} ms left, its "
                    f"batch expected to take {(finish - now) * 1000:.1f} ms); it was not computed"))
        return kept

    def _keep_version(self, requests: list[QueuedRequest], model: str, version: str) -> list[QueuedRequest]:
        """The requests `version` may compute: a request that named another version (live when it came,
        replaced since) is answered `unavailable`, never computed by another version."""
        if all(r.header.version in (None, version) for r in requests):
            return requests
        kept = []
        for request in requests:
            named = request.header.version
            if named in (None, version):
                kept.append(request)
            else:
                self.replies.error(
                    request, protocol.UNAVAILABLE,
                    f"version {named!r} of {model} was replaced by {version!r} while the request waited", version)
        return kept

    def run_shadow_jobs(self, now: float) -> None:
        """Send waiting shadow jobs to idle executors of their candidate; drop those too old to be worth it.
        The caller calls this only while no request waits."""
        for job in self.shadow_jobs.stale(now):
            self.stats.shadow_series(job.model, job.version).dropped["stale"] += len(job.samples)
        while self.shadow_jobs:
            job = self.shadow_jobs.jobs[0]
            idle = [e for e in self.workers.executors_for(job.model, job.version) if e.inflight == 0]
            # Where the live version has several executors, one stays idle for the next request.
            live = self.workers.executors_serving(job.model, self.live[job.model])
            if not idle or (len(live) > 1 and sum(e.inflight == 0 for e in live) < 2):
                return
            # The coldest idle executor: the warm one is left to the next live request (a cold executor
            # doubles batch-1 latency on the CPU), so shadow compute times read high there.
            executor = min(idle, key=lambda e: e.last_used)
            worker = executor.worker
            slot = worker.slots.acquire()
            if slot is None:
                return
            self.shadow_jobs.jobs.popleft()
            base = worker.slots.offset(slot)
            offsets, _ = place(base, [len(data) for _, data in job.inputs])
            refs = []
            for (ref, data), offset in zip(job.inputs, offsets):
                worker.arena.buf[offset:offset + len(data)] = data
                refs.append(TensorRef(ref.dtype, ref.shape, offset))
            batch = Batch(next(self._ids), job.model, job.version, [], executor, slot, now, sum(job.samples),
                          tuple(refs), shadow_job=job)
            message = RunBatch(batch.id, job.model, job.version, base, worker.slots.slot_size, batch.inputs,
                               job.samples, (now + MAX_AGE_S,) * len(job.samples),
                               self.config.models[job.model].retry_lost_batches)
            if not self.workers.send(executor.identity, message):
                worker.slots.release(slot)
                self.stats.shadow_series(job.model, job.version).dropped["worker unreachable"] += len(job.samples)
                continue
            # The candidate's time for it is not known; the live version's is the nearest guess.
            self.workers.batch_sent(executor, 0, now, job.live_compute_s)
            self.inflight[batch.id] = batch
            self._running_shadow_jobs.add(executor)

    def end_trial(self, model: str) -> None:
        """`model`'s trial ended: its waiting shadow jobs are dropped (counted), its split forgotten."""
        self._splits.pop(model, None)
        for job in self.shadow_jobs.discard(model):
            self.stats.shadow_series(job.model, job.version).dropped["trial ended"] += len(job.samples)

    def split_share(self, model: str) -> float | None:
        """The share of `model`'s samples routed to its candidate at its present weight, if it has one."""
        split = self._splits.get(model)
        return split.share() if split is not None and split.candidate is self.candidates.get(model) else None

    def on_result(self, executor: ExecutorHandle, result: BatchDone | BatchFailed) -> None:
        """Answer every request of a finished batch and free its slot."""
        batch = self.inflight.get(result.batch_id)
        if batch is None or batch.executor is not executor:
            log.warning("result for unknown batch %d ignored", result.batch_id)
            return
        del self.inflight[batch.id]
        worker = executor.worker
        trackers: list[zmq.MessageTracker] = []
        now = time.monotonic()
        if batch.shadow_job is not None:
            self._running_shadow_jobs.discard(executor)
            self.workers.batch_returned(executor, 0, True, now)
            try:
                self._compared(batch, batch.shadow_job, result)
            finally:
                worker.slots.release(batch.slot)
            return
        if isinstance(result, BatchFailed):
            self.workers.batch_returned(executor, len(batch.requests), True, now)
            self.replies.failed(batch, result.error, result.status)
        else:
            computed = len(result.expired) < len(batch.requests)
            self.workers.batch_returned(executor, len(batch.requests), computed, now)
            # A batch run one request at a time (one of them raised) took no batch's time.
            timed = computed and not result.each
            if timed and batch.version == self.live[batch.model]:  # not an old version's last batches
                samples = batch.samples
                if result.expired:
                    samples -= sum(batch.requests[index].samples for index in result.expired)
                self.times.observe(batch.model, batch.version, samples, result.compute_us / 1e6, batch.elements)
            self.workers.note_memory(worker, result.memory, result.reserved, result.growth, batch.describe)
            # One slot per worker at most waits on a slow reader; while it does, replies are copied,
            # so a client that does not read cannot take every slot of a worker.
            by_reference = not any(w is worker for w, _, _ in self.sending)
            trackers = self.replies.computed(batch, result, by_reference)
            if batch.copy_for_shadow:  # the slot is still held: copy it for the candidate once clients have theirs
                try:
                    self._keep_for_shadow(batch, result, now)
                except Exception:  # noqa: BLE001 - shadow work must never cost live work its slot
                    failure("copying a batch for its shadow")
            if timed:
                self._watch_slow(batch, result.compute_us / 1e6)
        if trackers:
            # Replies still read the slot; it is free once ZeroMQ has sent them.
            self.sending.append((worker, batch.slot, trackers))
        else:
            worker.slots.release(batch.slot)

    def _keep_for_shadow(self, batch: Batch, result: BatchDone, now: float) -> None:
        """Copy a live batch's inputs and outputs into a shadow job, unless the shadow queue is full."""
        candidate = self.candidates.get(batch.model)
        if candidate is None or candidate.mode != Mode.SHADOW:
            return
        series = self.stats.shadow_series(batch.model, candidate.version)
        requests = len(batch.requests)
        series.chosen += requests
        if self.shadow_jobs.full() or result.expired or result.each:
            reason = "stale" if result.expired else "a request failed" if result.each else "queue full"
            series.dropped[reason] += requests
            return
        buf = batch.executor.worker.arena.buf

        def copied(ref: TensorRef) -> tuple[TensorRef, bytes]:
            return ref, bytes(buf[ref.offset:ref.offset + ref.nbytes()])

        self.shadow_jobs.add(ShadowJob(batch.model, candidate.version, [copied(r) for r in batch.inputs],
                                  [copied(r) for r in result.outputs], tuple(r.samples for r in batch.requests),
                                  result.compute_us / 1e6, now))

    def _compared(self, batch: Batch, job: ShadowJob, result: BatchDone | BatchFailed) -> None:
        """A shadow batch came back: its outputs against the live version's, and its compute time."""
        series = self.stats.shadow_series(job.model, job.version)
        requests = len(job.samples)
        if isinstance(result, BatchFailed):
            series.failed += requests
            log.warning("shadow %s failed: %s", batch.describe(), result.error)
            return
        if result.expired:
            series.dropped["stale"] += requests
            return
        if result.each:  # one of them raised: those that did count as failed, and the batch is not compared
            series.failed += len(result.failed)
            series.dropped["a request failed"] += requests - len(result.failed)
            log.warning("shadow %s: %d of %d requests failed", batch.describe(), len(result.failed), requests)
            return
        buf = batch.executor.worker.arena.buf
        outputs = [(ref, buf[ref.offset:ref.offset + ref.nbytes()])
                   for ref in result.outputs]
        comparison = compare(job.outputs, outputs, job.samples)
        series.compared += comparison.requests
        series.allclose += comparison.allclose
        series.mismatched += 0 if comparison.comparable else comparison.requests
        series.max_abs = max(series.max_abs, comparison.max_abs)
        series.max_rel = max(series.max_rel, comparison.max_rel)
        series.live_compute.add(job.live_compute_s)
        series.shadow_compute.add(result.compute_us / 1e6)

    def release_sent(self) -> None:
        """Free the slots whose replies ZeroMQ has finished sending."""
        still = []
        for worker, slot, trackers in self.sending:
            if all(t.done for t in trackers):
                worker.slots.release(slot)
            else:
                still.append((worker, slot, trackers))
        self.sending = still

    def fail_worker(self, worker: WorkerHandle, reason: str, status: str = protocol.INTERNAL,
                    retry: bool = False) -> list[QueuedRequest]:
        """Take back the slots of every batch in flight on `worker` and answer its requests with `status`;
        with `retry` (the worker died while the daemon serves), return instead the requests to compute
        again: those of a model with retry_lost_batches whose batch had not been lost before. A request
        lost with a second worker is answered `internal`: it is not tried a third time."""
        now = time.monotonic()
        again: list[QueuedRequest] = []
        for batch in [b for b in self.inflight.values() if b.executor.worker is worker]:
            del self.inflight[batch.id]
            self.workers.batch_returned(batch.executor, len(batch.requests), False, now)
            worker.slots.release(batch.slot)
            if batch.shadow_job is not None:
                self._running_shadow_jobs.discard(batch.executor)
                series = self.stats.shadow_series(batch.model, batch.version)
                series.dropped["worker lost"] += len(batch.shadow_job.samples)
                continue
            model = self.config.models.get(batch.model)
            if not retry or model is None or not model.retry_lost_batches:
                self.replies.failed(batch, reason, status)
                continue
            twice = []
            for request in batch.requests:
                if request.answered:
                    continue
                request.lost_with = (*request.lost_with, worker.name)
                if request.cancelled:
                    self.replies.error(request, protocol.CANCELLED, CANCELLED_ERROR, batch.version)
                elif len(request.lost_with) > 1:
                    twice.append(request)
                else:
                    again.append(request)
            if len(twice) < len(batch.requests):
                log.warning("%s lost (%s); its requests are computed again", batch.describe(), reason)
            if twice:
                log.error("%s killed a second worker (%s): requests %s are answered internal", batch.describe(),
                          reason, ", ".join(str(r.header.id) for r in twice))
            for request in twice:
                self.replies.error(request, protocol.INTERNAL, (
                    f"its batch killed two workers ({', '.join(request.lost_with)}); it is not tried a third time: "
                    f"{reason}"), batch.version)
        return again

    def cancel_running(self, client: Hashable, request_id: protocol.RequestId) -> bool:
        """Mark `client`'s request `request_id` cancelled if its batch runs: its result will be dropped
        and it answered `cancelled`. False when no running batch holds it."""
        for batch in self.inflight.values():
            for request in batch.requests:
                if (request.header.id == request_id and request.client == client and not request.cancelled
                        and not request.answered):
                    request.cancelled = True
                    return True
        return False

    def next_deadline(self) -> float:
        """The soonest deadline of a request in a running batch not answered yet (monotonic; inf if none)."""
        return min((batch.deadline for batch in self.inflight.values()), default=math.inf)

    def expire_running(self, now: float) -> None:
        """Answer `timeout` now each request of a running batch whose deadline has passed, rather than when
        its batch comes back, which behind a long batch may be much later; what comes back for it is
        dropped. A cancelled one is answered `cancelled` when its batch is back, as before."""
        for batch in self.inflight.values():
            if batch.deadline > now:
                continue
            for request in batch.requests:
                if request.deadline <= now and not (request.answered or request.cancelled):
                    self.replies.late(request, batch.version)
            batch.deadline = min((r.deadline for r in batch.requests if not (r.answered or r.cancelled)),
                                 default=math.inf)

    def free_within(self, now: float, seconds: float) -> bool:
        """Whether a ready executor holds no batch, or is expected to have computed what it holds within
        `seconds`: only then can what arrives (or its answer) be acted on at once."""
        return any(executor.free_at() <= now + seconds for worker in self.workers.workers
                   if worker.state == WorkerState.READY for executor in worker.executors)

    def oldest(self) -> Batch | None:
        """The batch that has been running longest, if any runs."""
        return min(self.inflight.values(), key=lambda b: b.started, default=None)

    def running(self, worker: WorkerHandle, model: str) -> int:
        """Batches of any version of `model` running on `worker`."""
        return sum(b.executor.worker is worker and b.model == model for b in self.inflight.values())

    def has_inflight(self, worker: WorkerHandle, model: str, version: str) -> bool:
        """True while a batch of `version` of `model` runs on `worker`."""
        return any(
            b.executor.worker is worker and b.model == model and b.version == version for b in self.inflight.values()
        )

    def _watch_slow(self, batch: Batch, compute_s: float) -> None:
        """Warn (at most every SLOW_WARN_EVERY_S per model) about a batch far slower than its model's median."""
        series = self.stats.since_start.get((batch.model, batch.version))
        if series is None or series.compute.count < SLOW_MIN_COUNT:
            return
        key = (batch.model, batch.version)
        counted, median = self._medians.get(key, (0, 0.0))
        if series.compute.count - counted >= SLOW_MIN_COUNT:
            counted, median = series.compute.count, series.compute.quantile(0.5)
            self._medians[key] = (counted, median)
        now = time.monotonic()
        if compute_s > max(SLOW_FACTOR * median, SLOW_MIN_S) \
                and now - self._slow_warned.get(batch.model, -math.inf) > SLOW_WARN_EVERY_S:
            self._slow_warned[batch.model] = now
            log.warning("%s on %s took %.1f ms, over %dx the median %.1f ms", batch.describe(),
                        batch.executor.worker.name, compute_s * 1000, SLOW_FACTOR, median * 1000)

    def _pick_executor(self, model: str, version: str) -> ExecutorHandle | None:
        executors = self.workers.executors_for(model, version)
        if not executors:
            return None
        # Least busy first; among equals the one used last, whose thread, core
        # caches and model weights are still warm (a cold executor doubles
        # batch-1 latency on the CPU). Load spreads as executors fill. Never
        # behind shadow work while another executor is as free.
        if self._running_shadow_jobs:
            best = max(executors, key=lambda e: (-e.inflight, e not in self._running_shadow_jobs, e.last_used))
        else:
            best = max(executors, key=lambda e: (-e.inflight, e.last_used))
        return best if best.inflight < PIPELINE_DEPTH else None

    def _elements(self, model: str, requests: list[QueuedRequest]) -> int | None:
        """Input elements of each sample of a batch of `requests`, where the model takes inputs of any size."""
        spec = self.config.models[model]
        return sum(math.prod(shape) for shape in padding.batch_shapes(spec, requests)) if spec.variable else None

    def _count_shape(self, batch: Batch) -> None:
        """Count the batch by its shape, with the elements its requests brought and the padding it computed."""
        computed = sum(math.prod(ref.shape) for ref in batch.inputs)
        real = sum(math.prod(meta.shape) for request in batch.requests for meta in request.header.inputs)
        self.stats.shaped_batch(batch.model, "x".join(map(str, batch.inputs[0].shape[1:])), real, computed - real)

    def _cuts(self, model: str, version: str) -> tuple[unpad.Cut, ...]:
        spec = self.config.models[model]
        if not spec.padded:
            return ()
        return unpad.cuts(spec, self.workers.signature(model, version) or ())

    def _stack(self, batch: Batch, worker: WorkerHandle) -> RunBatch:
        """Copy each input of every request, one after the other, into the slot."""
        spec = self.config.models[batch.model]
        buf = worker.arena.buf
        base, size = worker.slots.offset(batch.slot), worker.slots.slot_size
        samples = sum(r.samples for r in batch.requests)
        shapes = padding.batch_shapes(spec, batch.requests)
        sizes = [sum(len(r.buffers[index]) for r in batch.requests) if s.dtype == protocol.BYTES
                 else samples * protocol.tensor_bytes(s.dtype, shape)
                 for index, (s, shape) in enumerate(zip(spec.inputs, shapes))]
        offsets, end = place(base, sizes)
        if end > base + size:
            raise SlotOverflow
        refs = []
        for index, (input_spec, shape, start, nbytes) in enumerate(zip(spec.inputs, shapes, offsets, sizes)):
            ends = (nbytes,) if input_spec.dtype == protocol.BYTES else ()
            refs.append(TensorRef(input_spec.dtype, (samples, *shape), start, ends))
            if input_spec.pad_value is not None and any(tuple(r.header.inputs[index].shape[1:]) != shape
                                                        for r in batch.requests):
                padding.stack_padded(buf[start:start + nbytes], input_spec.dtype, shape, input_spec.pad_value,
                                     batch.requests, index, UnreadableInput)
                continue
            offset = start
            for request in batch.requests:
                value = request.buffers[index]
                end = offset + len(value)
                if isinstance(value, RegionSlice):
                    try:
                        value.read_into(buf[offset:end])
                        if input_spec.dtype == protocol.BYTES:  # a frame's were checked as it was decoded
                            _check_bytes(buf[offset:end], request.header.inputs[index], index)
                    except InvalidRequest as exc:
                        raise UnreadableInput(request, exc) from None
                else:
                    buf[offset:end] = value
                offset = end
        return RunBatch(
            batch_id=batch.id,
            model=batch.model,
            version=batch.version,
            slot_offset=base,
            slot_size=size,
            inputs=tuple(refs),
            samples=tuple(r.samples for r in batch.requests),
            deadlines=tuple(r.deadline for r in batch.requests),
            retry_alone=spec.retry_lost_batches,
        )


def _check_bytes(data: memoryview, meta: protocol.TensorMeta, index: int) -> None:
    """InvalidRequest unless `data` holds the elements of BYTES input `index` (`meta`) as the layout says."""
    try:
        protocol.bytes_ends(data, math.prod(meta.shape))
    except ValueError as exc:
        raise InvalidRequest(f"input {index} is bytes {list(meta.shape)} in region {meta.region!r}, and its "
                             f"{exc}") from None


def slot_need(spec: ModelConfig, outputs: Sequence[TensorSpec], request: QueuedRequest) -> int:
    """About what one request of a model with BYTES inputs takes of a slot: its inputs, and its outputs (a
    BYTES one taken as large as the request's BYTES inputs: only the model knows its size), each aligned."""
    inputs = [len(buffer) for buffer in request.buffers]
    in_bytes = sum(size for size, input_spec in zip(inputs, spec.inputs) if input_spec.dtype == protocol.BYTES)
    sizes = [*inputs, *(in_bytes if output.dtype == protocol.BYTES
                        else request.samples * protocol.tensor_bytes(output.dtype, output.shape)
                        for output in outputs)]
    return sum(align_up(size) for size in sizes)
