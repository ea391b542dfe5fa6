"""Liveness: the loop step that finds workers that stopped making progress and ends them.

Liveness means progress: a batch past workers.batch_timeout_s, a boot past
workers.start_timeout_s, a load past workers.load_timeout_s, a stop past
STOP_TIMEOUT_S, and an idle worker's main thread answering a Ping within
workers.batch_timeout_s (at least PING_MIN_S): one that wedges between batches
is found before a batch waits on it. A worker hung in a batch gets SIGABRT (its Python stacks go to
the log), then SIGKILL; one hung in a load is taken out of service and killed
once its running batches are back. Its death then goes the usual way (reap,
answer what it held, respawn), so nothing here answers a request itself.
"""

from __future__ import annotations

import logging

from inferd.ipc import messages
from inferd.supervisor.dispatch.batch import Batch
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.processes.children import STOP_TIMEOUT_S
from inferd.supervisor.processes.workers import ABORT_GRACE_S, WorkerHandle, WorkerState, WorkerTable
from inferd.supervisor.versions.reload import ReloadManager

log = logging.getLogger("inferd.liveness")

IDLE_CHECK_S = 0.5
PING_MIN_S = 1.0  # a ping's answer may take this long however short workers.batch_timeout_s is


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
        return oldest, (f"{oldest.describe()} on {worker.name} ran longer than "
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
                log.error("%s did not become ready within %g s; killing it", worker.name,
                          config.start_timeout_s)
                worker.kill()
            elif worker.state == WorkerState.STOPPING and now - worker.stopping_since > STOP_TIMEOUT_S:
                log.warning("%s did not stop within %g s; killing it", worker.name, STOP_TIMEOUT_S)
                worker.kill()
            elif worker.state == WorkerState.REPLACING and not worker.inflight:
                worker.kill()
            elif worker.state == WorkerState.READY:
                self._ping(worker, now, config.batch_timeout_s)

    def _ping(self, worker: WorkerHandle, now: float, limit: float) -> None:
        """Ping an idle worker every half `limit`; abort one that leaves a Ping unanswered past `limit`. A worker
        that runs a batch (the batch timeout watches it) or loads a version (in its main thread) is not judged.
        An aborted one is asked again each check, which kills it once the abort's grace has passed."""
        if worker.inflight or worker.loading:
            worker.ping_sent = None
            return
        if worker.ping_sent is not None:
            if now - worker.ping_sent > max(limit, PING_MIN_S):
                self.workers.abort_hung(worker, f"{worker.name} did not answer a ping within "
                                                f"{max(limit, PING_MIN_S):g} s while idle (workers.batch_timeout_s)",
                                        now)
        elif now - worker.pinged_at >= limit / 2 and self.workers.send_control(worker, messages.Ping(now)):
            worker.ping_sent = worker.pinged_at = now

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
