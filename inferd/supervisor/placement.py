"""Where on-demand models live: placed on a worker when a request needs them, taken off it when asked.

    request for M ──▶ queue ──▶ place_waiting: no worker holds M ──▶ M placed on the ready worker holding the
                                                                     fewest on-demand models; the reload manager's
                                                                     catch-up loads M's live version there
    loaded ──▶ M's batches go to that worker (the dispatcher routes by what each worker has loaded)
    refused ──▶ M's waiting requests are answered `unavailable` with the worker's error, and new ones refused,
                until M's backoff passes (1 s, doubling to 60 s): a broken file is not loaded for every request

A model with `load = "always"` is on every worker from its start and is never
placed or taken off. Placement decides; the worker table writes the record
(`WorkerHandle.placed`) and the reload manager loads and unloads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from inferd import protocol
from inferd.config.schema import Config
from inferd.supervisor.control_server import Reply
from inferd.supervisor.dispatch import Dispatcher
from inferd.supervisor.live import LiveVersions
from inferd.supervisor.queue import RequestQueue
from inferd.supervisor.reload import ReloadManager
from inferd.supervisor.replies import Replies
from inferd.supervisor.workers import WorkerHandle, WorkerState, WorkerTable

log = logging.getLogger("inferd.placement")

FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0


@dataclass
class LoadFailure:
    """Why an on-demand model could not be loaded, and until when it is not tried again."""

    error: str
    until: float
    backoff_s: float


@dataclass
class PendingLoad:
    """A load of an on-demand model under way, and who waits for it."""

    worker: WorkerHandle
    asked: float
    replies: list[Reply] = field(default_factory=list)  # `inferctl load` commands answered when it ends


class Placement:
    """Places on-demand models on workers and takes them off; the one that decides where they live."""

    def __init__(self, config: Config, workers: WorkerTable, reloads: ReloadManager, dispatcher: Dispatcher,
                 queue: RequestQueue, replies: Replies, live: LiveVersions) -> None:
        self.config = config
        self.workers = workers
        self.reloads = reloads
        self.dispatcher = dispatcher
        self.queue = queue
        self.replies = replies
        self.live = live
        self.failures: dict[str, LoadFailure] = {}
        self.pending: dict[str, PendingLoad] = {}
        reloads.on_caught_up = self._caught_up

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): the models and which of them load on demand."""
        self.config = config

    def _on_demand(self, model: str) -> bool:
        config = self.config.models.get(model)
        return config is not None and config.on_demand

    def refusals(self, now: float) -> dict[str, str]:
        """The on-demand models whose last load failed and whose backoff has not passed: why, as a sentence."""
        return {model: f"{model} {self.live.get(model)} could not be loaded ({failure.error}); it is tried again "
                       f"in {failure.until - now:.1f} s"
                for model, failure in self.failures.items() if now < failure.until}

    def place_waiting(self, now: float) -> None:
        """Place each on-demand model that has requests waiting and is on no worker."""
        for model, lane in self.queue.lanes.items():
            if not lane.samples or model in self.pending or not self._on_demand(model):
                continue
            if any(model in worker.placed for worker in self.workers.workers):
                continue
            failure = self.failures.get(model)
            if failure is not None and now < failure.until:
                continue
            worker = self._choose()
            if worker is not None:
                self._place(worker, model, now)

    def load(self, model: str, reply: Reply) -> None:
        """`inferctl load`: make sure a worker has `model`'s live version; answer once one has it."""
        version = self.live[model]
        serving = [w.index for w in self.workers.workers if w.serves(model, version)]
        if serving:
            reply.finish({"model": model, "version": version, "workers": serving, "loaded": False})
            return
        pending = self.pending.get(model)
        if pending is None:
            if not self._on_demand(model):
                reply.fail(f"no ready worker has {model} {version}; see inferctl status")
                return
            worker = self._choose()
            if worker is None:
                reply.fail(f"no worker is ready to load {model}; see inferctl status")
                return
            self.failures.pop(model, None)  # asked for by name: tried now, whatever the backoff says
            pending = self._place(worker, model, time.monotonic())
        reply.progress(f"loading {model} {version} on worker{pending.worker.index}",
                       wait_s=self.config.workers.load_timeout_s)
        pending.replies.append(reply)

    def unload(self, model: str) -> dict[str, Any]:
        """`inferctl unload`: take on-demand `model` off every worker, once it is idle; ValueError says why not."""
        if not self._on_demand(model):
            raise ValueError(f'{model} is loaded on every worker (load = "always"); set models.{model}.load = '
                             '"on_demand" to load and unload it')
        holders = [w for w in self.workers.workers if model in w.placed]
        waiting = self.queue.depth(model)
        running = sum(self.dispatcher.running(w, model) for w in holders)
        if waiting or running:
            raise ValueError(f"{model} has {running} batch(es) running and {waiting} request(s) waiting; it is "
                             "unloaded only when idle: try again once they are answered")
        for worker in holders:
            self._take_off(worker, model, "asked by inferctl unload")
        return {"model": model, "workers": [w.index for w in holders]}

    def on_worker_exit(self, worker: WorkerHandle) -> None:
        """A worker died: the loads it had under way are asked again elsewhere, by the requests still waiting."""
        for model, pending in list(self.pending.items()):
            if pending.worker is worker:
                del self.pending[model]
                for reply in pending.replies:
                    reply.fail(f"worker{worker.index} died while loading {model}")

    def _choose(self) -> WorkerHandle | None:
        """The ready worker to load an on-demand model on: the one holding the fewest."""
        ready = [w for w in self.workers.workers if w.state == WorkerState.READY]
        return min(ready, key=lambda w: (len(w.placed), w.index), default=None)

    def _place(self, worker: WorkerHandle, model: str, now: float) -> PendingLoad:
        self.workers.place(worker, model, now)
        pending = self.pending[model] = PendingLoad(worker, now)
        log.info("loading %s %s on worker%d (on demand)", model, self.live[model], worker.index)
        self.reloads.catch_up(worker)
        return pending

    def _take_off(self, worker: WorkerHandle, model: str, why: str) -> None:
        self.workers.unplace(worker, model)
        self.reloads.retire_from(worker, model)
        log.info("unloading %s from worker%d (%s)", model, worker.index, why)

    def _caught_up(self, worker: WorkerHandle, model: str, error: str | None) -> None:
        """The reload manager's word on a live version loaded on `worker` (error None) or refused."""
        pending = self.pending.get(model)
        if not self._on_demand(model) or pending is None or pending.worker is not worker:
            return
        del self.pending[model]
        now = time.monotonic()
        version = self.live[model]
        if error is None:
            self.failures.pop(model, None)
            log.info("%s %s loaded on worker%d in %.2f s (on demand)", model, version, worker.index,
                     now - pending.asked)
            for reply in pending.replies:
                reply.finish({"model": model, "version": version, "workers": [worker.index], "loaded": True,
                              "load_s": round(now - pending.asked, 3)})
            return
        self.workers.unplace(worker, model)
        last = self.failures.get(model)
        backoff = FIRST_BACKOFF_S if last is None else min(MAX_BACKOFF_S, last.backoff_s * 2)
        self.failures[model] = LoadFailure(error, now + backoff, backoff)
        sentence = f"{model} {version} could not be loaded ({error}); it is tried again in {backoff:.1f} s"
        for reply in pending.replies:
            reply.fail(sentence)
        if not any(model in w.placed for w in self.workers.workers):
            for request in self.queue.remove_model(model):
                self.replies.error(request, protocol.UNAVAILABLE, sentence)
