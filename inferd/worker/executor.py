"""An executor: one thread of a worker that runs one batch at a time.

It reads the batch in place from the arena (`arrays.from_numpy` over the shared
buffer, no copy), skips the requests whose deadline has passed, runs the model,
writes the outputs back into the same slot (as ipc/slots.py lays them out) and
answers with a small descriptor. On a GPU each executor owns a CUDA stream, so
one executor's copies overlap another's compute.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time

import numpy as np
import torch
import zmq

from inferd.arrays import from_numpy
from inferd.ipc import messages
from inferd.ipc.arena import Arena
from inferd.ipc.messages import BatchDone, BatchFailed, Hello, RunBatch, TensorRef
from inferd.ipc.slots import place
from inferd.protocol import DTYPES, tensor_bytes
from inferd.worker.exits import WorkerExit
from inferd.worker.runner import DTYPE_NAMES, ModelRunner, describe_error

log = logging.getLogger("inferd.worker.executor")

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# CUDA errors after which the context is unusable for every later call (the sticky ones);
# any other error, out of memory above all, fails its batch and the worker serves on.
STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegal instruction", "misaligned address", "invalid program counter",
    "unspecified launch failure", "device-side assert", "hardware stack error", "uncorrectable ecc error",
    "launch timed out", "not supported on global/shared address space",
)


def arena_tensor(arena: Arena, dtype: str, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A CPU tensor that is a view of the arena at `offset` (no copy)."""
    return from_numpy(np.ndarray(shape, dtype=DTYPES[dtype], buffer=arena.buf, offset=offset))


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the device (or host) running out of memory, which fails only its batch."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """True for a CUDA error that leaves the device context unusable (only a new process can serve)."""
    text = str(exc).lower()
    return not is_out_of_memory(exc) and "cuda" in text and any(error in text for error in STICKY_CUDA_ERRORS)


class PhaseClock:
    """Marks between a batch's phases (inputs in, forward, outputs out), read once the batch is done:
    the host clock on the CPU, CUDA events on a GPU, whose copies and kernels run after the host has
    moved on."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._times: list[float] = []
        self._events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        """Note that a phase ends here (the first mark is where the first begins)."""
        if self._stream is None:
            self._times.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        self._events.append(event)

    def phases_us(self) -> tuple[int, int, int]:
        """Each phase's length in microseconds; on a GPU, call it after the stream has synchronized."""
        if self._stream is None:
            spans = [(end - start) * 1e6 for start, end in itertools.pairwise(self._times)]
        else:
            spans = [start.elapsed_time(end) * 1e3 for start, end in itertools.pairwise(self._events)]
        first, second, third = (int(span) for span in spans)
        return first, second, third


class Overlap:
    """Tells an executor whether its batch ran alone in the worker: only then is the memory its
    batch grew by its own (another executor's activations would count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._began = 0

    def begin(self) -> int:
        """A batch starts; returns its token."""
        with self._lock:
            self._running += 1
            self._began += 1
            return self._began if self._running == 1 else -1

    def end(self, token: int) -> bool:
        """The batch of `token` ended; True when no other batch ran at any moment of it."""
        with self._lock:
            self._running -= 1
            return token == self._began


class Executor(threading.Thread):
    """Runs the batches sent to its own socket, one at a time, on its own stream."""

    def __init__(
        self,
        index: int,
        context: zmq.Context,
        backend: str,
        hello: Hello,
        arena: Arena,
        runner: ModelRunner,
        stop_fd: int,
        overlap: Overlap,
    ) -> None:
        super().__init__(name=f"executor-{index}", daemon=True)
        self.index = index
        self.arena = arena
        self._base = arena.address()
        self.runner = runner
        self.stop_fd = stop_fd
        self.overlap = overlap
        self.busy = False  # read by the worker's main thread: it trims GPU memory only when all are idle
        self.socket = context.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(backend)
        self.socket.send(messages.encode(hello))
        device = runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cpu_threads = torch.get_num_threads() if self.stream is None else None  # workers.cpu_threads
        # Read around every batch: a descriptor kept open costs one pread, where opening the
        # file each time cost several times that.
        self._statm = os.open("/proc/self/statm", os.O_RDONLY) if self.stream is None else None

    def run(self) -> None:
        """Serve batches until `stop_fd` becomes readable."""
        if self.stream is not None:
            # The current device is per thread: without this, a worker on cuda:1 would run on cuda:0.
            torch.cuda.set_device(self.runner.device)
        if self._cpu_threads is not None:
            # So is OpenMP's thread count: a new thread gets one per core, and MKL then ran each matmul on
            # a team whose threads spin-wait for each other. Beside a busy core that made a 50 ms batch
            # take 400 ms (the idle-CPU test's backlog stalled behind a CPU burner).
            torch.set_num_threads(self._cpu_threads)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.stop_fd, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.stop_fd in ready:
                    return
                message = messages.decode(self.socket.recv())
                if isinstance(message, RunBatch):
                    self.busy = True
                    result = self.run_batch(message)
                    self.busy = False
                    self.socket.send(messages.encode(result))
        finally:
            self.socket.close()
            if self._statm is not None:
                os.close(self._statm)

    def run_batch(self, batch: RunBatch) -> BatchDone | BatchFailed:
        """Run one batch; any failure becomes a BatchFailed naming it, never a dead thread.

        Requests whose deadline has passed are not computed: they are named in the
        answer's `expired`, and only the others' rows go through the model.
        """
        now = time.monotonic()
        expired = tuple(i for i, deadline in enumerate(batch.deadlines) if deadline <= now)
        if len(expired) == len(batch.samples):
            return BatchDone(batch.batch_id, (), 0, *self.memory(), 0, expired)
        token = self.overlap.begin()
        before = self.memory()[0]
        started = time.perf_counter()
        clock = PhaseClock(self.stream)
        try:
            outputs = self._compute(batch, expired, clock)
        except Exception as exc:  # noqa: BLE001 - a model may raise anything
            self.overlap.end(token)
            return self._failed(batch, exc, len(expired))
        compute_us = int((time.perf_counter() - started) * 1e6)
        memory, reserved = self.memory()
        growth = memory - before if self.overlap.end(token) else 0
        return BatchDone(batch.batch_id, outputs, compute_us, memory, reserved, growth, expired, clock.phases_us())

    def _failed(self, batch: RunBatch, exc: Exception, expired: int) -> BatchFailed:
        samples = sum(batch.samples) - expired
        what = f"batch {batch.batch_id} of {batch.model} {batch.version}, {samples} samples"
        if is_out_of_memory(exc):
            # Its activations are gone with the exception; give the allocator's cache back so the
            # next batch finds the memory this one could not.
            self.runner.release_memory()
            error = f"out of memory on {self.runner.device} for {what}"
        else:
            error = describe_error(exc)
        log.error("%s failed: %s", what, error)
        if is_sticky_cuda_error(exc):
            # The context is poisoned for every later call: leave, and let the supervisor
            # answer what ran here and start a clean worker.
            log.error("a CUDA error that poisons the device context: exiting so that a fresh worker takes over")
            logging.shutdown()
            os._exit(WorkerExit.CUDA_ERROR)
        return BatchFailed(batch.batch_id, error)

    def memory(self) -> tuple[int, int]:
        """(bytes in use, bytes reserved): the device allocator's on a GPU, resident host memory on the CPU."""
        if self.stream is not None:
            device = self.runner.device
            return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        assert self._statm is not None
        return int(os.pread(self._statm, 128, 0).split()[1]) * PAGE_SIZE, 0

    def _compute(self, batch: RunBatch, expired: tuple[int, ...], clock: PhaseClock) -> tuple[TensorRef, ...]:
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with stream:
            clock.mark()
            inputs = [arena_tensor(self.arena, ref.dtype, ref.shape, ref.offset) for ref in batch.inputs]
            if expired:
                rows = _live_rows(batch.samples, expired)
                inputs = [torch.cat([x[start:end] for start, end in rows]) for x in inputs]
            model, staged = self.runner.stage(batch.model, batch.version, inputs, self.index)
            clock.mark()
            outputs = model.run(staged)
            clock.mark()
            inputs_end = place(batch.slot_offset, [tensor_bytes(ref.dtype, ref.shape) for ref in batch.inputs])[1]
            refs = self._write_outputs(outputs, inputs_end, batch.slot_offset, batch.slot_offset + batch.slot_size)
            clock.mark()
            if self.stream is not None:
                # Wait for this stream's copies only, not for the whole device.
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()
        return refs

    def _write_outputs(self, outputs: tuple[torch.Tensor, ...], start: int, slot_start: int,
                       slot_end: int) -> tuple[TensorRef, ...]:
        """Put each output in the slot after the inputs; one already in the slot stays where it is."""
        names = []
        for output in outputs:
            dtype = DTYPE_NAMES.get(output.dtype)
            if dtype is None:
                raise TypeError(f"output dtype {output.dtype} cannot travel on the wire")
            names.append(dtype)
        # An output that is (a view of) an input needs no copy: the slot stays untouched until its reply has gone.
        in_place = [self._offset_in_slot(output, slot_start, slot_end) for output in outputs]
        copied = [o for o, at in zip(outputs, in_place) if at is None]
        offsets, end = place(start, [o.numel() * o.element_size() for o in copied])
        if end > slot_end:
            raise MemoryError(f"the outputs need more than the {slot_end - start} bytes left in the arena slot; "
                              "raise workers.shm_mb")
        destinations = iter(offsets)
        refs = []
        for output, dtype, where in zip(outputs, names, in_place):
            shape = tuple(output.shape)
            at = where if where is not None else next(destinations)
            if where is None:
                arena_tensor(self.arena, dtype, shape, at).copy_(output, non_blocking=True)
            refs.append(TensorRef(dtype, shape, at))
        return tuple(refs)

    def _offset_in_slot(self, output: torch.Tensor, slot_start: int, slot_end: int) -> int | None:
        """The arena offset of a contiguous CPU output that lies inside this batch's slot, else None."""
        if output.device.type != "cpu" or not output.is_contiguous():
            return None
        offset = output.data_ptr() - self._base
        if slot_start <= offset and offset + output.numel() * output.element_size() <= slot_end:
            return offset
        return None


def _live_rows(samples: tuple[int, ...], expired: tuple[int, ...]) -> list[tuple[int, int]]:
    """The row ranges of the requests not in `expired`, merged where they touch."""
    rows: list[tuple[int, int]] = []
    gone = set(expired)
    start = 0
    for index, count in enumerate(samples):
        if index not in gone:
            if rows and rows[-1][1] == start:
                rows[-1] = (rows[-1][0], start + count)
            else:
                rows.append((start, start + count))
        start += count
    return rows
