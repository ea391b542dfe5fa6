"""An executor: one thread of a worker that runs one batch at a time.

It reads the batch in place from the arena (`torch.from_numpy` over the shared
buffer, no copy), runs the model, writes the outputs back into the same slot
and answers with a small descriptor. On a GPU each executor owns a CUDA stream,
so one executor's copies overlap another's compute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import numpy as np
import torch
import zmq

from inferd.ipc import messages
from inferd.ipc.arena import Arena, align_up
from inferd.ipc.messages import BatchDone, BatchFailed, Hello, RunBatch, TensorRef
from inferd.protocol import DTYPES
from inferd.worker.main import EXIT_CUDA_ERROR
from inferd.worker.runner import DTYPE_NAMES, ModelRunner, describe_error

log = logging.getLogger("inferd.worker.executor")

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def arena_tensor(arena: Arena, dtype: str, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A CPU tensor that is a view of the arena at `offset` (no copy)."""
    return torch.from_numpy(np.ndarray(shape, dtype=DTYPES[dtype], buffer=arena.buf, offset=offset))


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
    ) -> None:
        super().__init__(name=f"executor-{index}", daemon=True)
        self.index = index
        self.arena = arena
        self._base = arena.address()
        self.runner = runner
        self.stop_fd = stop_fd
        self.busy = False  # read by the worker's main thread: it trims GPU memory only when all are idle
        self.socket = context.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(backend)
        self.socket.send(messages.encode(hello))
        device = runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Read after every batch: a descriptor kept open costs one pread, where opening the
        # file each time cost several times that.
        self._statm = os.open("/proc/self/statm", os.O_RDONLY) if self.stream is None else None

    def run(self) -> None:
        """Serve batches until `stop_fd` becomes readable."""
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
        """Run one batch; any failure becomes a BatchFailed naming it, never a dead thread."""
        started = time.perf_counter()
        try:
            outputs = self._compute(batch)
        except Exception as exc:
            error = describe_error(exc)
            log.error("batch %d of %s %s failed: %s", batch.batch_id, batch.model, batch.version, error)
            if self.stream is not None and "CUDA error" in str(exc):
                # A CUDA error poisons the context for every later call: leave, and
                # let the supervisor answer what ran here and start a clean worker.
                log.error("CUDA error: exiting so that a fresh worker takes over")
                logging.shutdown()
                os._exit(EXIT_CUDA_ERROR)
            return BatchFailed(batch.batch_id, error)
        compute_us = int((time.perf_counter() - started) * 1e6)
        return BatchDone(batch.batch_id, outputs, compute_us, *self.memory())

    def memory(self) -> tuple[int, int]:
        """(bytes in use, bytes reserved): the device allocator's on a GPU, resident host memory on the CPU."""
        if self.stream is not None:
            device = self.runner.device
            return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return int(os.pread(self._statm, 128, 0).split()[1]) * PAGE_SIZE, 0

    def _compute(self, batch: RunBatch) -> tuple[TensorRef, ...]:
        device = self.runner.device
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with stream:
            inputs = [
                arena_tensor(self.arena, ref.dtype, ref.shape, ref.offset).to(device, non_blocking=True)
                for ref in batch.inputs
            ]
            outputs = self.runner.infer(batch.model, batch.version, inputs)
            refs = self._write_outputs(outputs, batch.out_offset, batch.out_end,
                                       min(ref.offset for ref in batch.inputs))
            if self.stream is not None:
                # Wait for this stream's copies only, not for the whole device.
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()
        return refs

    def _write_outputs(self, outputs: tuple[torch.Tensor, ...], start: int, end: int,
                       slot_start: int) -> tuple[TensorRef, ...]:
        """Put each output in the slot after the inputs; one already in the slot stays where it is."""
        refs = []
        offset = start
        for output in outputs:
            dtype = DTYPE_NAMES.get(output.dtype)
            if dtype is None:
                raise TypeError(f"output dtype {output.dtype} cannot travel on the wire")
            nbytes = output.numel() * output.element_size()
            in_place = self._offset_in_slot(output, slot_start, end)
            if in_place is not None:
                # An output that is (a view of) an input needs no copy: the slot
                # stays untouched until its reply has gone.
                refs.append(TensorRef(dtype, tuple(output.shape), in_place))
                continue
            offset = align_up(offset)
            if offset + nbytes > end:
                raise MemoryError(
                    f"the outputs need more than the {end - start} bytes left in the arena slot; "
                    "raise workers.shm_mb"
                )
            shape = tuple(output.shape)
            arena_tensor(self.arena, dtype, shape, offset).copy_(output, non_blocking=True)
            refs.append(TensorRef(dtype, shape, offset))
            offset += nbytes
        return tuple(refs)

    def _offset_in_slot(self, output: torch.Tensor, slot_start: int, slot_end: int) -> int | None:
        """The arena offset of a contiguous CPU output that lies inside this batch's slot, else None."""
        if output.device.type != "cpu" or not output.is_contiguous():
            return None
        offset = output.data_ptr() - self._base
        if slot_start <= offset and offset + output.numel() * output.element_size() <= slot_end:
            return offset
        return None
