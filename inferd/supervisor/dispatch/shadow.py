"""Shadow work: batches the live version answered, waiting to be recomputed by the candidate.

    live batch chosen ──▶ on its result: inputs and outputs copied ──▶ ShadowQueue
                                                                          │ an executor idle and no
                                                                          ▼ request waiting
                                  compare(live outputs, candidate's) ◀── candidate computes it

Shadow work never waits ahead of a client's request: a job runs only on an
executor with nothing to do while the queue is empty, the queue holds a few
jobs at most (a full one drops the new job), and a job that waited longer
than MAX_AGE_S is dropped; every drop is counted. A job's bytes are copies,
so the slot it came from is free at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from inferd.config.schema import CANARY_ATOL, CANARY_RTOL
from inferd.ipc.messages import TensorRef
from inferd.protocol import BYTES, DTYPES, Buffer

MAX_JOBS = 4
MAX_AGE_S = 1.0
# What counts as the same output: the tolerance the load-time canary check uses.


@dataclass(eq=False)
class ShadowJob:
    """One live batch to recompute with the candidate."""

    model: str
    version: str  # the candidate
    inputs: list[tuple[TensorRef, bytes]]  # each input of the whole batch (the ref's offset is unused)
    outputs: list[tuple[TensorRef, bytes]]  # the live version's outputs of it
    samples: tuple[int, ...]  # per request
    live_compute_s: float
    created: float


class ShadowQueue:
    """The jobs waiting for idle executor time, oldest first."""

    def __init__(self) -> None:
        self.jobs: deque[ShadowJob] = deque()

    def __len__(self) -> int:
        return len(self.jobs)

    def full(self) -> bool:
        """True when a new job would be dropped."""
        return len(self.jobs) >= MAX_JOBS

    def add(self, job: ShadowJob) -> None:
        """Queue `job` (the caller checked `full`)."""
        self.jobs.append(job)

    def stale(self, now: float) -> list[ShadowJob]:
        """Remove and return the jobs that waited past MAX_AGE_S."""
        gone = []
        while self.jobs and now - self.jobs[0].created > MAX_AGE_S:
            gone.append(self.jobs.popleft())
        return gone

    def discard(self, model: str) -> list[ShadowJob]:
        """Remove and return every job of `model` (its trial ended)."""
        gone = [job for job in self.jobs if job.model == model]
        self.jobs = deque(job for job in self.jobs if job.model != model)
        return gone


@dataclass(frozen=True)
class Comparison:
    """How the candidate's outputs of one batch differ from the live version's."""

    requests: int
    allclose: int  # requests whose every output is allclose (CANARY_RTOL, CANARY_ATOL) to the live one
    max_abs: float  # 0 when the outputs differ in count, dtype or shape (then `comparable` is False)
    max_rel: float
    comparable: bool = True


def compare(live: list[tuple[TensorRef, bytes]], candidate: list[tuple[TensorRef, memoryview]],
            samples: tuple[int, ...]) -> Comparison:
    """Compare each request's rows of every output; outputs of another shape or count match nothing."""
    if len(live) != len(candidate) or any(a.shape != b.shape or a.dtype != b.dtype
                                          for (a, _), (b, _) in zip(live, candidate)):
        return Comparison(len(samples), 0, 0.0, 0.0, comparable=False)
    starts = np.r_[0, np.cumsum(samples)[:-1]]
    close = np.ones(len(samples), dtype=bool)
    max_abs = max_rel = 0.0
    for (ref, want_bytes), (got_ref, got_bytes) in zip(live, candidate):
        if ref.dtype == BYTES:  # byte strings match or they do not
            close &= np.array([_samples(ref, want_bytes, int(first), count) == _samples(got_ref, got_bytes, int(first),
                                                                                         count)
                               for first, count in zip(starts, samples)], dtype=bool)
            continue
        dtype = DTYPES[ref.dtype]
        want = np.frombuffer(want_bytes, dtype).reshape(ref.shape[0], -1).astype(np.float64)
        got = np.frombuffer(got_bytes, dtype).reshape(ref.shape[0], -1).astype(np.float64)
        difference = np.abs(got - want)
        if difference.size:
            max_abs = max(max_abs, float(difference.max()))
            # Against CANARY_ATOL where the live output is (nearly) zero, so a ReLU's zeros do not read as infinite.
            max_rel = max(max_rel, float((difference / np.maximum(np.abs(want), CANARY_ATOL)).max()))
        close &= np.logical_and.reduceat((difference <= CANARY_ATOL + CANARY_RTOL * np.abs(want)).all(axis=1), starts)
    return Comparison(len(samples), int(close.sum()), max_abs, max_rel)


def _samples(ref: TensorRef, data: Buffer, first: int, count: int) -> bytes:
    """Samples `first` to `first + count` of a BYTES output whose bytes are `data` (from its offset on)."""
    start, end = ref.rows(first, count)
    return bytes(data[start - ref.offset:end - ref.offset])
