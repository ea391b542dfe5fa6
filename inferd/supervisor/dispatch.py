"""The dispatcher: batches into arena slots and out to executors, results back to requests.

A batch is stacked once, straight from the received frames into a free slot of
the chosen worker's arena; the worker gets only a descriptor. When it answers,
each request's rows of every output are sent back as its reply and the slot is
free again. A batch whose worker fails is answered `internal`, request by request.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import zmq

from inferd import protocol
from inferd.config import Config
from inferd.ipc.arena import align_up
from inferd.ipc.messages import BatchDone, BatchFailed, RunBatch, TensorRef
from inferd.protocol import ReplyHeader, TensorMeta, Timing
from inferd.supervisor.batcher import QueuedRequest
from inferd.supervisor.frontend import Frontend
from inferd.supervisor.stats import Stats
from inferd.supervisor.workers import PIPELINE_DEPTH, ExecutorHandle, WorkerHandle, WorkerTable

log = logging.getLogger("inferd.dispatch")

SLOW_FACTOR = 5  # a batch this many times its model's median compute time gets a warning
SLOW_MIN_COUNT = 50  # ... once the median rests on this many measurements
SLOW_WARN_EVERY_S = 10.0


@dataclass(eq=False)
class Batch:
    """A batch in flight: its requests, where it runs, and which slot holds it."""

    id: int
    model: str
    version: str
    requests: list[QueuedRequest]
    executor: ExecutorHandle
    slot: int
    started: float


def slot_bytes_needed(config: Config, model: str, outputs: tuple) -> int:
    """Bytes of one slot that a full batch of `model` needs, inputs and outputs, aligned."""
    spec = config.models[model]
    total = 0
    per_sample = [(s.dtype, s.shape) for s in spec.inputs] + [(o.dtype, o.shape) for o in outputs]
    for dtype, shape in per_sample:
        total = align_up(total) + spec.max_batch_size * math.prod(shape) * protocol.DTYPES[dtype].itemsize
    return total


def slot_shortfall(config: Config, model: str, outputs: tuple, slot_size: int) -> str | None:
    """Why a full batch of `model` with these outputs would not fit a slot of `slot_size` bytes; None if it fits."""
    needed = slot_bytes_needed(config, model, outputs)
    if needed <= slot_size:
        return None
    return (f"a full batch of {model} needs {needed / 2**20:.1f} MiB of arena slot but a slot has "
            f"{slot_size / 2**20:.1f} MiB (workers.shm_mb / (2 x workers.streams)); "
            "raise workers.shm_mb or lower max_batch_size")


class SlotOverflow(Exception):
    """A batch's inputs would run past the end of its slot."""


class Dispatcher:
    """Sends batches to executors and turns their answers into replies."""

    def __init__(self, config: Config, workers: WorkerTable, frontend: Frontend, live: dict[str, str],
                 stats: Stats) -> None:
        self.config = config
        self.workers = workers
        self.frontend = frontend
        self.live = live
        self.stats = stats
        self.inflight: dict[int, Batch] = {}
        self.sending: list[tuple[WorkerHandle, int, list[zmq.MessageTracker]]] = []
        self._medians: dict[tuple[str, str], tuple[int, float]] = {}
        self._slow_warned: dict[str, float] = {}
        self._ids = itertools.count(1)

    def capacity(self, model: str) -> tuple[bool, bool]:
        """For `model`'s live version: (some executor is idle, some executor can take one more batch)."""
        idle = spare = False
        for executor in self.workers.executors_for(model, self.live[model]):
            idle = idle or executor.inflight == 0
            spare = spare or executor.inflight < PIPELINE_DEPTH
        return idle, spare

    def dispatch(self, model: str, requests: list[QueuedRequest]) -> None:
        """Copy `requests` into a slot of the least busy executor of the live version and send it there."""
        version = self.live[model]
        executor = self._pick_executor(model, version)
        if executor is None:
            for request in requests:
                self.frontend.reply_error(request, protocol.UNAVAILABLE, "no worker is ready")
            return
        worker = executor.worker
        slot = worker.slots.acquire()
        if slot is None:  # cannot happen while slots = executors x depth; never lose requests if it does
            for request in requests:
                self.frontend.reply_error(request, protocol.INTERNAL, "no free arena slot")
            return
        now = time.monotonic()
        batch = Batch(next(self._ids), model, version, requests, executor, slot, now)
        try:
            message = self._stack(batch, worker)
        except SlotOverflow:  # the load-time slot checks make this unreachable; never write past a slot
            worker.slots.release(slot)
            for request in requests:
                self.frontend.reply_error(request, protocol.INTERNAL, "the batch does not fit an arena slot")
            return
        if not self.workers.send(executor.identity, message):
            worker.slots.release(slot)
            self._fail(batch, f"worker{worker.index} cannot be reached")
            return
        executor.inflight += 1
        executor.last_used = now
        self.inflight[batch.id] = batch
        self.stats.batch(now, model, version, sum(r.samples for r in requests))

    def on_result(self, executor: ExecutorHandle, result: BatchDone | BatchFailed) -> None:
        """Answer every request of a finished batch and free its slot."""
        batch = self.inflight.get(result.batch_id)
        if batch is None or batch.executor is not executor:
            log.warning("result for unknown batch %d ignored", result.batch_id)
            return
        self._finish(batch)
        executor.worker.batches += 1
        trackers: list[zmq.MessageTracker] = []
        if isinstance(result, BatchFailed):
            self._fail(batch, result.error)
        else:
            self.workers.note_memory(executor.worker, result.memory, result.reserved)
            # One slot per worker at most waits on a slow reader; while it does, replies are copied,
            # so a client that does not read cannot take every slot of a worker.
            by_reference = not any(worker is executor.worker for worker, _, _ in self.sending)
            trackers = self._reply_outputs(batch, result, by_reference)
            self._watch_slow(batch, result.compute_us / 1e6)
        if trackers:
            # Replies still read the slot; it is free once ZeroMQ has sent them.
            self.sending.append((executor.worker, batch.slot, trackers))
        else:
            executor.worker.slots.release(batch.slot)

    def release_sent(self) -> None:
        """Free the slots whose replies ZeroMQ has finished sending."""
        still = []
        for worker, slot, trackers in self.sending:
            if all(t.done for t in trackers):
                worker.slots.release(slot)
            else:
                still.append((worker, slot, trackers))
        self.sending = still

    def fail_worker(self, worker: WorkerHandle, reason: str, status: str = protocol.INTERNAL) -> None:
        """Answer every batch in flight on `worker` with `status` and take its slots back."""
        for batch in [b for b in self.inflight.values() if b.executor.worker is worker]:
            self._finish(batch)
            worker.slots.release(batch.slot)
            self._fail(batch, reason, status)

    def _finish(self, batch: Batch) -> None:
        del self.inflight[batch.id]
        batch.executor.inflight -= 1

    def oldest(self) -> Batch | None:
        """The batch that has been running longest, if any runs."""
        return min(self.inflight.values(), key=lambda b: b.started, default=None)

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
        if compute_s > SLOW_FACTOR * median and now - self._slow_warned.get(batch.model, -math.inf) > SLOW_WARN_EVERY_S:
            self._slow_warned[batch.model] = now
            log.warning("batch %d of %s %s on worker%d took %.1f ms, over %dx the median %.1f ms",
                        batch.id, batch.model, batch.version, batch.executor.worker.index, compute_s * 1000,
                        SLOW_FACTOR, median * 1000)

    def _pick_executor(self, model: str, version: str) -> ExecutorHandle | None:
        executors = self.workers.executors_for(model, version)
        if not executors:
            return None
        # Least busy first; among equals the one used last, whose thread, core
        # caches and model weights are still warm (measured: a cold executor
        # doubles batch-1 latency on the CPU). Load spreads as executors fill.
        best = max(executors, key=lambda e: (-e.inflight, e.last_used))
        return best if best.inflight < PIPELINE_DEPTH else None

    def _stack(self, batch: Batch, worker: WorkerHandle) -> RunBatch:
        """Copy each input of every request, one after the other, into the slot."""
        spec = self.config.models[batch.model]
        buf = worker.arena.buf
        base = worker.slots.offset(batch.slot)
        samples = sum(r.samples for r in batch.requests)
        end = base + worker.slots.slot_size
        offset = base
        refs = []
        for index, input_spec in enumerate(spec.inputs):
            offset = align_up(offset)
            refs.append(TensorRef(input_spec.dtype, (samples, *input_spec.shape), offset))
            for request in batch.requests:
                data = request.buffers[index]
                if offset + len(data) > end:
                    raise SlotOverflow
                buf[offset : offset + len(data)] = data
                offset += len(data)
        return RunBatch(
            batch_id=batch.id,
            model=batch.model,
            version=batch.version,
            inputs=tuple(refs),
            out_offset=align_up(offset),
            out_end=end,
        )

    def _reply_outputs(self, batch: Batch, done: BatchDone, by_reference: bool) -> list[zmq.MessageTracker]:
        """Send each request its rows of every output; with `by_reference`, large ones without a copy
        (the trackers of those are returned)."""
        buf = batch.executor.worker.arena.buf
        row_bytes = [
            math.prod(ref.shape[1:]) * protocol.DTYPES[ref.dtype].itemsize for ref in done.outputs
        ]
        now = time.monotonic()
        # Requests of a batch mostly carry the same sample count: their output metadata is shared.
        metas: dict[int, tuple[TensorMeta, ...]] = {}
        replies = []
        row = 0
        for request in batch.requests:
            samples = request.samples
            outputs = metas.get(samples)
            if outputs is None:
                outputs = metas[samples] = tuple(TensorMeta(ref.dtype, (samples, *ref.shape[1:]))
                                                 for ref in done.outputs)
            frames = [
                buf[ref.offset + row * size : ref.offset + (row + samples) * size]
                for ref, size in zip(done.outputs, row_bytes)
            ]
            timing = Timing(queue=int((batch.started - request.received) * 1e6), compute=done.compute_us,
                            total=int((now - request.received) * 1e6))
            header = ReplyHeader(id=request.header.id, status=protocol.OK, model=batch.model,
                                 version=batch.version, outputs=outputs, timing_us=timing)
            replies.append((request, header, frames))
            row += samples
        trackers = self.frontend.reply_ok(replies, by_reference)
        self.stats.answered(now, batch.model, batch.version, row,
                            [now - r.received for r in batch.requests],
                            [batch.started - r.received for r in batch.requests], done.compute_us / 1e6)
        return trackers

    def _fail(self, batch: Batch, reason: str, status: str = protocol.INTERNAL) -> None:
        log.error("batch %d of %s (%d requests) failed: %s", batch.id, batch.model, len(batch.requests), reason)
        for request in batch.requests:
            self.frontend.reply_error(request, status, reason)
