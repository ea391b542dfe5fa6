"""Liveness: the loop step that finds workers that stopped making progress and ends them.

Liveness means progress: a batch past workers.batch_timeout_s, a boot past
workers.start_timeout_s, a load past workers.load_timeout_s, a stop past
STOP_TIMEOUT_S. A worker hung in a batch gets SIGABRT (its Python stacks go to
the log), then SIGKILL; one hung in a load is taken out of service and killed
once its running batches are back. Its death then goes the usual way (reap,
answer what it held, respawn), so nothing here answers a request itself.
"""

from __future__ import annotations

import logging

from inferd.supervisor.children import STOP_TIMEOUT_S
from inferd.supervisor.dispatch import Batch, Dispatcher
from inferd.supervisor.reload import ReloadManager
from inferd.supervisor.workers import ABORT_GRACE_S, WorkerState, WorkerTable

log = logging.getLogger("inferd.liveness")

IDLE_CHECK_S = 0.5


class Liveness:
    """Checks every worker's progress and ends what is hung."""

    def __init__(self, workers: WorkerTable, dispatcher: Dispatcher, reloads: ReloadManager) -> None:
        self.workers = workers
        self.dispatcher = dispatcher
        self.reloads = reloads

    def hung(self, now: float) -> tuple[Batch, str] | None:
        """The batch that ran past workers.batch_timeout_s (the longest running), and the sentence for it."""
        limit = self.workers.config.workers.batch_timeout_s
        oldest = self.dispatcher.oldest()
        if oldest is None or now - oldest.started <= limit:
            return None
        worker = oldest.executor.worker
        return oldest, (f"{oldest.describe()} on worker{worker.index} ran longer than "
                        f"workers.batch_timeout_s ({limit:g} s)")

    def check(self, now: float) -> None:
        """End what is hung; due at the times next_check_in gives, and on the housekeeping tick."""
        config = self.workers.config.workers
        hung = self.hung(now)
        if hung is not None:
            self.workers.abort_hung(hung[0].executor.worker, hung[1], now)
        self.reloads.check_loads(now)
        for worker in self.workers.workers:
            if worker.state == WorkerState.BOOTING and now - worker.started > config.start_timeout_s:
                self.workers.note_error(worker, f"did not become ready within {config.start_timeout_s:g} s")
                log.error("worker%d did not become ready within %g s; killing it", worker.index,
                          config.start_timeout_s)
                worker.kill()
            elif worker.state == WorkerState.STOPPING and now - worker.stopping_since > STOP_TIMEOUT_S:
                log.warning("worker%d did not stop within %g s; killing it", worker.index, STOP_TIMEOUT_S)
                worker.kill()
            elif worker.state == WorkerState.REPLACING and not worker.inflight:
                worker.kill()

    def next_check_in(self, now: float) -> float:
        """Seconds until a running batch needs a look: when it would count as hung, or when its hung
        worker is due for SIGKILL. Once both have passed, the worker's exit wakes the loop."""
        oldest: Batch | None = self.dispatcher.oldest()
        if oldest is None:
            return IDLE_CHECK_S
        worker = oldest.executor.worker
        due = (oldest.started + self.workers.config.workers.batch_timeout_s if worker.hung is None
               else worker.hung_since + ABORT_GRACE_S)
        return due - now + 0.001 if due >= now else IDLE_CHECK_S
