"""A worker's executor: the compute of one batch with torch (the loop around it, and the rule that a bad request
fails alone, are inferd.compute.executor's).

It reads the batch in place from the arena (`arrays.from_numpy` over the shared
buffer, no copy), runs the model on the rows it is given, and writes the outputs
back into the same slot (as ipc/slots.py lays them out). On a GPU each executor
owns a CUDA stream, so one executor's copies overlap another's compute.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time

import numpy as np
import torch
import zmq

from inferd import protocol
from inferd.arrays import from_numpy
from inferd.compute import executor as compute
from inferd.compute.executor import Computed, Overlap, Rows, describe_error, output_offsets
from inferd.errors import MODEL_ERROR_CHARS, cut
from inferd.ipc.arena import Arena
from inferd.ipc.messages import Hello, RunBatch, TensorRef
from inferd.protocol import DTYPES
from inferd.worker.exits import WorkerExit
from inferd.worker.runner import DTYPE_NAMES, ModelRunner

log = logging.getLogger("inferd.worker.executor")
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


class Executor(compute.Executor):
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
        super().__init__(index, context, backend, hello, stop_fd, overlap)
        self.arena = arena
        self._base = arena.address()
        self.runner = runner
        device = runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.shares_inputs = self.stream is None  # on a GPU, the model gets copies on its device
        self._cpu_threads = torch.get_num_threads() if self.stream is None else None  # workers.cpu_threads

    def prepare(self) -> None:
        """Bind this thread to the worker's device, or on the CPU to workers.cpu_threads."""
        if self.stream is not None:
            # The current device is per thread: without this, a worker on cuda:1 would run on cuda:0.
            torch.cuda.set_device(self.runner.device)
        if self._cpu_threads is not None:
            # So is OpenMP's thread count: a new thread gets one per core, and MKL then ran each matmul on
            # a team whose threads spin-wait for each other. Beside a busy core that made a 50 ms batch
            # take 400 ms (the idle-CPU test's backlog stalled behind a CPU burner).
            torch.set_num_threads(self._cpu_threads)

    def on_failure(self, exc: BaseException) -> None:
        """Out of memory: give the allocator's cache back, so the next batch finds the memory this one could
        not (its activations are gone with the exception). A CUDA error that poisons the device context: exit,
        and let the supervisor answer what ran here and start a clean worker."""
        if is_out_of_memory(exc):
            self.runner.release_memory()
        elif is_sticky_cuda_error(exc):
            log.error("a CUDA error that poisons the device context (%s): exiting so that a fresh worker takes "
                      "over", describe_error(exc))
            logging.shutdown()
            os._exit(WorkerExit.CUDA_ERROR)

    def failure(self, batch: RunBatch, exc: BaseException, samples: int) -> tuple[str, str]:
        """Out of memory is said as such; any other exception as every compute process says it."""
        if is_out_of_memory(exc):
            return protocol.INTERNAL, (f"out of memory on {self.runner.device} for batch {batch.batch_id} "
                                               f"of {batch.model} {batch.version}, {samples} samples")
        return super().failure(batch, exc, samples)

    def exception_text(self, exc: BaseException) -> str:
        """A TorchScript error carries the model's exception, type and message, on its traceback's last line."""
        if isinstance(exc, torch.jit.Error):
            return cut(describe_error(exc), MODEL_ERROR_CHARS)
        return super().exception_text(exc)

    def memory(self) -> tuple[int, int]:
        """(bytes in use, bytes reserved): the device allocator's on a GPU, resident host memory on the CPU."""
        if self.stream is not None:
            device = self.runner.device
            return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return super().memory()

    def compute(self, batch: RunBatch, rows: list[Rows], start: int) -> Computed:
        """The model on `rows` of the batch, its outputs written into the slot from `start`."""
        clock = PhaseClock(self.stream)
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with stream:
            clock.mark()
            inputs = [arena_tensor(self.arena, ref.dtype, ref.shape, ref.offset) for ref in batch.inputs]
            if rows != [(0, inputs[0].shape[0])]:
                inputs = [x[rows[0][0]:rows[0][1]] if len(rows) == 1 else torch.cat([x[a:b] for a, b in rows])
                          for x in inputs]
            model, staged = self.runner.stage(batch.model, batch.version, inputs, self.index)
            clock.mark()
            outputs = model.run(staged)
            clock.mark()
            refs, end = self._write_outputs(outputs, start, batch.slot_offset, batch.slot_offset + batch.slot_size)
            clock.mark()
            if self.stream is not None:
                # Wait for this stream's copies only, not for the whole device.
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()
        return Computed(refs, end, clock.phases_us())

    def _write_outputs(self, outputs: tuple[torch.Tensor, ...], start: int, slot_start: int,
                       slot_end: int) -> tuple[tuple[TensorRef, ...], int]:
        """Put each output in the slot from `start` on; one already in the slot stays where it is. The refs, and
        the offset past the last one written."""
        names = []
        for output in outputs:
            dtype = DTYPE_NAMES.get(output.dtype)
            if dtype is None:
                raise TypeError(f"output dtype {output.dtype} cannot travel on the wire")
            names.append(dtype)
        in_place = [self._offset_in_slot(output, slot_start, slot_end) for output in outputs]
        offsets, end = output_offsets(in_place, [o.numel() * o.element_size() for o in outputs], start, slot_end)
        refs = []
        for output, dtype, where, at in zip(outputs, names, in_place, offsets):
            shape = tuple(output.shape)
            if where is None:
                arena_tensor(self.arena, dtype, shape, at).copy_(output, non_blocking=True)
            refs.append(TensorRef(dtype, shape, at))
        return tuple(refs), end

    def _offset_in_slot(self, output: torch.Tensor, slot_start: int, slot_end: int) -> int | None:
        """The arena offset of a contiguous CPU output that lies inside this batch's slot, else None."""
        if output.device.type != "cpu" or not output.is_contiguous():
            return None
        offset = output.data_ptr() - self._base
        if slot_start <= offset and offset + output.numel() * output.element_size() <= slot_end:
            return offset
        return None
