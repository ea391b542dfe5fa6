"""A step's executor: the compute of one batch of a Python model, over numpy views of the arena (the loop around
it, and the rule that a bad request fails alone, are inferd.compute.executor's).

The model gets each input as a read-only numpy array over the arena slot itself (no copy; a BYTES input, as an
object array of `bytes`); its outputs are copied into the slot after the inputs, except one that already lies in
the slot (an input given back, or a view of one), which stays where it is. A BYTES output is written in the
wire's layout, with where each sample ends.
"""

from __future__ import annotations

import time

import numpy as np
import zmq

from inferd.compute import executor as compute
from inferd.compute.executor import Computed, Overlap, Rows, output_offsets
from inferd.ipc.arena import Arena
from inferd.ipc.messages import Hello, RunBatch, TensorRef
from inferd.protocol import BYTES, DTYPES, bytes_array, pack_bytes
from inferd.step.runner import PythonRunner

DTYPE_NAMES = {np.dtype(dtype): name for name, dtype in DTYPES.items()} | {np.dtype(object): BYTES}


class StepExecutor(compute.Executor):
    """Runs the batches of a Python model sent to its socket, one at a time."""

    def __init__(self, index: int, context: zmq.Context, backend: str, hello: Hello, arena: Arena,
                 runner: PythonRunner, stop_fd: int, overlap: Overlap) -> None:
        super().__init__(index, context, backend, hello, stop_fd, overlap)
        self.arena = arena
        self.runner = runner
        self._bytes = np.frombuffer(arena.buf, dtype=np.uint8)
        self._base = self._bytes.ctypes.data

    def compute(self, batch: RunBatch, rows: list[Rows], start: int) -> Computed:
        """The model on `rows` of the batch, its outputs written into the slot from `start`."""
        began = time.perf_counter()
        inputs = []
        for ref in batch.inputs:
            whole = self._input(ref)
            part = whole[rows[0][0]:rows[0][1]] if len(rows) == 1 else np.concatenate([whole[a:b] for a, b in rows])
            part.flags.writeable = False  # the slot's bytes are the request's: the model reads them, never writes
            inputs.append(part)
        model = self.runner.get(batch.model, batch.version)
        called = time.perf_counter()
        outputs = model(inputs)
        returned = time.perf_counter()
        refs, end = self._write_outputs(outputs, start, batch.slot_offset, batch.slot_offset + batch.slot_size)
        written = time.perf_counter()
        phases = (int((called - began) * 1e6), int((returned - called) * 1e6), int((written - returned) * 1e6))
        return Computed(refs, end, phases)

    def _input(self, ref: TensorRef) -> np.ndarray:
        """A batch's input as the model reads it: a view of the slot, or of a BYTES input, an object array of
        its elements as `bytes` (the one copy a byte string takes)."""
        if ref.dtype == BYTES:
            return bytes_array(self.arena.buf[ref.offset:ref.offset + ref.nbytes()], ref.shape)
        return np.ndarray(ref.shape, dtype=DTYPES[ref.dtype], buffer=self.arena.buf, offset=ref.offset)

    def _write_outputs(self, outputs: list[np.ndarray], start: int, slot_start: int,
                       slot_end: int) -> tuple[tuple[TensorRef, ...], int]:
        """Put each output in the slot from `start` on, but one already in the slot; the refs, and the offset
        past the last one written."""
        payloads = [_payload(output) for output in outputs]
        in_place = [self._offset_in_slot(output, slot_start, slot_end) for output in outputs]
        offsets, end = output_offsets(in_place, [payload.nbytes for payload, _ in payloads], start, slot_end)
        refs = []
        for output, (payload, ends), where, at in zip(outputs, payloads, in_place, offsets):
            if where is None:
                self._bytes[at:at + payload.nbytes] = payload
            refs.append(TensorRef(DTYPE_NAMES[output.dtype], tuple(output.shape), at, ends))
        return tuple(refs), end

    def _offset_in_slot(self, output: np.ndarray, slot_start: int, slot_end: int) -> int | None:
        """The arena offset of a C-contiguous output that lies inside this batch's slot, else None (and None for
        a BYTES output, which is packed afresh)."""
        if not output.flags.c_contiguous or output.dtype == object:
            return None
        offset = output.ctypes.data - self._base
        return offset if slot_start <= offset and offset + output.nbytes <= slot_end else None


def _payload(output: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """An output's bytes as the slot holds them (a BYTES output's elements in the wire's layout), and where each
    sample's elements end in them (of a BYTES output; its replies split it there)."""
    if output.dtype != object:
        return output.reshape(-1).view(np.uint8), ()
    parts, ends, end = [], [], 0
    for sample in output.reshape(len(output), -1):
        part = pack_bytes(sample)
        end += len(part)
        parts.append(part)
        ends.append(end)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), tuple(ends)
