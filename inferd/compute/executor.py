"""An executor: one thread of a compute process (a worker, or a Python model's step) that runs one batch at a time.

It takes each RunBatch from its own socket, leaves out the requests whose deadline has passed, has its
process's kind compute the rest (`compute`: the inputs read in place from the arena slot, the outputs written
after them in the same slot, as ipc/slots.py lays them out), and answers with a small descriptor.

One bad request fails alone: a batch of several requests that raises is run again one request at a time
(unless the model is marked not safe to run twice, RunBatch.retry_alone), and each request that raises again is
answered with its own error while the others get their outputs. An error names the model, the version, the
exception's type and its message (cut to MODEL_ERROR_CHARS); `inferd.InvalidInput` is answered `invalid`, any
other exception `internal`.

Where the model is handed the slot's own memory (a step's, a CPU worker's), it may have changed its inputs in place
before it raised: the inputs of a batch that may run again are kept as they came (one copy of them), and each
request's rows are put back before it runs alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import zmq

from inferd import protocol
from inferd.errors import MODEL_ERROR_CHARS, InvalidInput, cut
from inferd.ipc import messages
from inferd.ipc.arena import Arena
from inferd.ipc.messages import BatchDone, BatchFailed, Hello, RequestFailed, RunBatch, TensorRef
from inferd.ipc.slots import place

log = logging.getLogger("inferd.compute.executor")

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

Rows = tuple[int, int]  # a range of a batch's rows: [start, end)


class Computed(NamedTuple):
    """What `compute` made of some rows of a batch: the outputs' refs, the slot offset just past them, and how
    its time divides into taking the inputs in, the model, and writing the outputs (BatchDone.phases_us)."""

    outputs: tuple[TensorRef, ...]
    end: int
    phases_us: tuple[int, int, int]


def describe_error(exc: BaseException) -> str:
    """One line for an exception: TorchScript errors carry a whole traceback; keep its last line."""
    if not isinstance(exc, Exception):  # SystemExit(0)'s message is only "0": name what it is
        return exception_text(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text.removeprefix("builtins.")


def exception_text(exc: BaseException) -> str:
    """An exception as an error reply names it: its type and its message, cut to MODEL_ERROR_CHARS."""
    return f"{type(exc).__name__}: {cut(str(exc).strip() or '(no message)', MODEL_ERROR_CHARS)}"


def output_offsets(in_place: Sequence[int | None], sizes: Sequence[int], start: int,
                   slot_end: int) -> tuple[list[int], int]:
    """Where each output of `sizes` bytes goes in a batch's slot: where it lies already (`in_place`: an input
    given back, or a view of one, needs no copy, the slot being the batch's until its replies have gone), else
    the next place from `start`; and the offset past the last one placed. MemoryError where they do not fit."""
    offsets, end = place(start, [size for size, at in zip(sizes, in_place) if at is None])
    if end > slot_end:
        raise MemoryError(f"the outputs need more than the {slot_end - start} bytes left in the arena slot; "
                          "raise workers.shm_mb")
    free = iter(offsets)
    return [at if at is not None else next(free) for at in in_place], end


def request_rows(samples: Sequence[int]) -> list[Rows]:
    """Each request's rows in a batch of requests of `samples` samples each, in row order."""
    rows, start = [], 0
    for count in samples:
        rows.append((start, start + count))
        start += count
    return rows


def merged(rows: Sequence[Rows]) -> list[Rows]:
    """`rows` (in order) with the ranges that touch made one."""
    found: list[Rows] = []
    for start, end in rows:
        if found and found[-1][1] == start:
            found[-1] = (found[-1][0], end)
        else:
            found.append((start, end))
    return found


class Overlap:
    """Tells an executor whether its batch ran alone in the process: only then is the memory its batch grew by
    its own (another executor's activations would count too)."""

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
    """Runs the batches sent to its own socket, one at a time; a kind of process says how (`compute`)."""

    arena: Arena  # its process's arena, which each kind attaches
    # Whether the model is handed its inputs in the slot itself, which it may change in place (a GPU worker's
    # model gets copies on its device).
    shares_inputs = True

    def __init__(self, index: int, context: zmq.Context, backend: str, hello: Hello, stop_fd: int,
                 overlap: Overlap) -> None:
        super().__init__(name=f"executor-{index}", daemon=True)
        self.index = index
        self.stop_fd = stop_fd
        self.overlap = overlap
        self.busy = False  # read by the process's main thread (a GPU worker trims memory only when all are idle)
        self.socket = context.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(backend)
        self.socket.send(messages.encode(hello))
        # Read around every batch: a descriptor kept open costs one pread, where opening the
        # file each time cost several times that.
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)

    def run(self) -> None:
        """Serve batches until `stop_fd` becomes readable."""
        self.prepare()
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
            os.close(self._statm)

    def prepare(self) -> None:
        """Set this thread up before its first batch (what is per thread: a device, a thread count)."""

    def compute(self, batch: RunBatch, rows: list[Rows], start: int) -> Computed:
        """Run `batch`'s model on its `rows` (ranges of its rows, in order) and write the outputs into its slot
        from offset `start` on."""
        raise NotImplementedError

    def memory(self) -> tuple[int, int]:
        """(bytes in use, bytes reserved): resident host memory, and 0 (a GPU worker says its allocator's)."""
        return int(os.pread(self._statm, 128, 0).split()[1]) * PAGE_SIZE, 0

    def exception_text(self, exc: BaseException) -> str:
        """An exception as an error reply names it (exception_text; a kind may know better)."""
        return exception_text(exc)

    def on_failure(self, exc: BaseException) -> None:
        """What the process does about an exception before anything is run again (a GPU worker gives its
        allocator's cache back, or exits for good after an error that poisons its device)."""

    def failure(self, batch: RunBatch, exc: BaseException, samples: int) -> tuple[str, str]:
        """The reply status and sentence for `samples` samples of `batch` that raised `exc`."""
        status = protocol.INVALID if isinstance(exc, InvalidInput) else protocol.INTERNAL
        return status, f"{batch.model} {batch.version}: {self.exception_text(exc)}"

    def run_batch(self, batch: RunBatch) -> BatchDone | BatchFailed:
        """Run one batch; any failure becomes a BatchFailed or a request's RequestFailed, never a dead thread.

        Requests whose deadline has passed are not computed: they are named in the answer's `expired`, and only
        the others' rows go through the model.
        """
        now = time.monotonic()
        expired = tuple(i for i, deadline in enumerate(batch.deadlines) if deadline <= now)
        if len(expired) == len(batch.samples):
            return BatchDone(batch.batch_id, (), 0, *self.memory(), 0, expired)
        rows = request_rows(batch.samples)
        gone = set(expired)
        live = [index for index in range(len(rows)) if index not in gone]
        start = place(batch.slot_offset, [ref.nbytes() for ref in batch.inputs])[1]
        token = self.overlap.begin()
        before = self.memory()[0]
        started = time.perf_counter()
        failed: tuple[RequestFailed, ...] = ()
        each: tuple[tuple[TensorRef, ...], ...] = ()
        # A model that changed its inputs in place (torch.from_numpy(x).mul_(2)) and then raised would have its
        # requests run again on what it made of them, and answer each a wrong `ok`.
        kept = self._inputs_now(batch, start) if self.shares_inputs and batch.retry_alone and len(live) > 1 \
            else None
        try:
            outputs, _, phases = self.compute(batch, merged([rows[i] for i in live]), start)
        # Not only Exception: a model's sys.exit() or KeyboardInterrupt would end this thread, and with it
        # every later batch of the process, without a reply.
        except BaseException as exc:  # noqa: BLE001 - a model may raise anything
            self.on_failure(exc)
            if not batch.retry_alone or len(live) < 2:
                self.overlap.end(token)
                status, error = self.failure(batch, exc, sum(batch.samples[i] for i in live))
                log.error("batch %d of %s %s failed: %s", batch.batch_id, batch.model, batch.version, error)
                return BatchFailed(batch.batch_id, error, status)
            outputs = ()
            each, failed, phases = self._one_at_a_time(batch, rows, live, start, exc, kept)
        compute_us = int((time.perf_counter() - started) * 1e6)
        memory, reserved = self.memory()
        growth = memory - before if self.overlap.end(token) else 0
        return BatchDone(batch.batch_id, outputs, compute_us, memory, reserved, growth, expired, phases, failed, each)

    def _inputs_now(self, batch: RunBatch, start: int) -> np.ndarray:
        """A copy of the bytes of `batch`'s inputs, which lie in its slot up to `start`."""
        return np.array(self._slot_bytes(batch.slot_offset, start))

    def _put_back(self, batch: RunBatch, kept: np.ndarray, rows: Rows) -> None:
        """Write `rows` of `batch`'s inputs back as `kept` (_inputs_now) holds them: only those, since the rows of
        a request run alone before may hold its output (an input given back)."""
        for ref in batch.inputs:
            if ref.dtype == protocol.BYTES:  # a model is handed its byte strings as `bytes`, which it cannot change
                continue
            row = ref.nbytes() // ref.shape[0]
            low, high = ref.offset + rows[0] * row, ref.offset + rows[1] * row
            self._slot_bytes(low, high)[:] = kept[low - batch.slot_offset:high - batch.slot_offset]

    def _slot_bytes(self, low: int, high: int) -> np.ndarray:
        return np.frombuffer(self.arena.buf, dtype=np.uint8, count=high - low, offset=low)

    def _one_at_a_time(self, batch: RunBatch, rows: list[Rows], live: list[int], start: int, exc: BaseException,
                       kept: np.ndarray | None,
                       ) -> tuple[tuple[tuple[TensorRef, ...], ...], tuple[RequestFailed, ...], tuple[int, int, int]]:
        """Run each of the `live` requests of a batch that raised `exc` alone, their outputs one after the other
        from `start`, each request's inputs first put back as `kept` holds them (where the model may have
        changed them): each one's refs (none for one not run, or failed), the requests that failed, the phases
        of those that ran, summed."""
        what = f"batch {batch.batch_id} of {batch.model} {batch.version}"
        log.warning("%s (%d requests) failed: %s; running each request alone", what, len(live),
                    self.failure(batch, exc, sum(batch.samples[i] for i in live))[1])
        each: list[tuple[TensorRef, ...]] = [()] * len(rows)
        failed = []
        phases = (0, 0, 0)
        for index in live:
            if kept is not None:
                self._put_back(batch, kept, rows[index])
            try:
                outputs, start, spent = self.compute(batch, [rows[index]], start)
            except BaseException as alone:  # noqa: BLE001 - a model may raise anything (see run_batch)
                self.on_failure(alone)
                status, error = self.failure(batch, alone, batch.samples[index])
                log.error("%s: request %d of %d failed alone: %s", what, index + 1, len(rows), error)
                failed.append(RequestFailed(index, status, error))
                continue
            each[index] = outputs
            phases = (phases[0] + spent[0], phases[1] + spent[1], phases[2] + spent[2])
        return tuple(each), tuple(failed), phases
