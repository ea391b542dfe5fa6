"""Where on-demand models live: placed on a worker when a request needs them, taken off to make room.

    request for M ──▶ queue ──▶ place_waiting: no worker holds M ──▶ a ready worker where M fits the budget,
                                                                     after unloading its least recently used
                                                                     idle on-demand models; the reload
                                                                     manager's catch-up loads M's live version
    loaded ──▶ M's batches go there (the dispatcher routes by what each worker has loaded)
    refused, or too big for the budget anywhere ──▶ M's waiting requests are answered `unavailable` with the
        reason, and new ones refused until M's backoff passes (1 s, doubling to 60 s): a broken file is not
        loaded again for every request

A model whose queue stays long while every executor it has is busy gets one
more copy, on another worker; a copy held elsewhere too is the first to be
unloaded. A model with `load = "always"` is on every worker from its start and
is never placed or taken off. Placement decides; the worker table writes the
record (`WorkerHandle.placed`), the reload manager loads and unloads, and the
memory each loaded version holds is what the worker measured after warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from inferd import protocol
from inferd.config.schema import Config
from inferd.models.repository import RepositoryError, model_file
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.dispatch.replies import Replies
from inferd.supervisor.processes.workers import WorkerHandle, WorkerState, WorkerTable
from inferd.supervisor.queueing.queue import RequestQueue
from inferd.supervisor.shared.command_replies import Reply
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.stats import Stats
from inferd.supervisor.versions.reload import ReloadManager

log = logging.getLogger("inferd.placement")

FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0
LONG_QUEUE_BATCHES = 2  # a queue of more full batches than this ...
LONG_FOR_S = 1.0  # ... for this long, with every executor of the model busy, gets the model one more copy


@dataclass
class LoadFailure:
    """Why an on-demand model could not be loaded, and until when it is not tried again."""

    error: str
    until: float
    backoff_s: float
    version: str  # the live version whose load failed: another made live since is tried at once


@dataclass
class PendingLoad:
    """A load of an on-demand model under way on one worker, and who waits for it."""

    worker: WorkerHandle
    asked: float
    replies: list[Reply] = field(default_factory=list)  # `inferctl load` commands answered when it ends


class Placement:
    """Places on-demand models on workers and takes them off; the one that decides where they live."""

    def __init__(self, config: Config, workers: WorkerTable, reloads: ReloadManager, dispatcher: Dispatcher,
                 queue: RequestQueue, replies: Replies, live: LiveVersions, stats: Stats) -> None:
        self.configure(config)
        self.workers = workers
        self.reloads = reloads
        self.dispatcher = dispatcher
        self.queue = queue
        self.replies = replies
        self.live = live
        self.stats = stats
        self.failures: dict[str, LoadFailure] = {}
        self.pending: dict[tuple[str, int], PendingLoad] = {}  # (model, worker index) -> its load
        self.sizes: dict[str, int] = {}  # model -> bytes its live version held when it last loaded
        self._long_since: dict[str, float] = {}  # model -> since when its queue has been long
        # `inferctl load` of an "always" model its workers are loading (one a rescan added): model -> replies.
        self._awaiting: dict[str, list[tuple[Reply, float]]] = {}
        # `inferctl load` of an on-demand model that waits for a worker to finish its load: model -> replies.
        self._asked: dict[str, list[tuple[Reply, float]]] = {}
        reloads.on_caught_up = self._caught_up

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): the models, which of them load on demand, the budget."""
        self.config = config
        self._on_demand_models = frozenset(name for name, model in config.models.items() if model.on_demand)

    @property
    def budget(self) -> int:
        """Bytes the models of one worker may hold (0: no bound)."""
        return int(self.config.workers.model_memory_mb * 2**20)

    def _on_demand(self, model: str) -> bool:
        return model in self._on_demand_models

    def refusals(self, now: float) -> dict[str, str]:
        """The on-demand models whose live version's last load failed and whose backoff has not passed: why, as a
        sentence."""
        return {model: self._sentence(model, failure.error, failure.until - now)
                for model in self.failures if (failure := self._failure(model)) is not None and now < failure.until}

    def _failure(self, model: str) -> LoadFailure | None:
        """The last failed load of `model`'s live version, if its last load failed."""
        failure = self.failures.get(model)
        return failure if failure is not None and failure.version == self.live.get(model) else None

    def loading(self, model: str) -> bool:
        """Whether a worker is loading `model` now (on demand)."""
        return any(name == model for name, _ in self.pending)

    def _sentence(self, model: str, error: str, retry_in: float) -> str:
        return f"{model} {self.live.get(model)} could not be loaded ({error}); it is tried again in {retry_in:.1f} s"

    # -- placing ------------------------------------------------------------------

    def place_waiting(self, now: float) -> None:
        """Place each on-demand model that has requests (or an `inferctl load`) waiting and is on no worker,
        the one that has waited longest first, and give a model whose queue stays long one more copy."""
        if not self._on_demand_models or (not len(self.queue) and not self._asked):
            return  # the loop calls this every turn: a daemon without on-demand models pays one test
        loading = {index for _, index in self.pending}
        if all(w.state != WorkerState.READY or w.index in loading for w in self.workers.device_workers):
            return  # no worker can start a load now: the loop turns of a busy daemon stay cheap
        unplaced = {model: replies[0][1] for model, replies in self._asked.items()}  # model -> waiting since
        for model, lane in list(self.queue.busy.items()):  # a refusal below empties its lane
            if not self._on_demand(model):
                continue
            holders = [w for w in self.workers.workers if model in w.placed]
            if not holders:
                failure = self._failure(model)
                if failure is None or now >= failure.until:
                    received = lane.oldest().received
                    unplaced[model] = min(received, unplaced.get(model, received))
            elif self._stays_long(model, lane.samples, holders, now):
                self._place_somewhere(model, now, evict=False)
        for model in sorted(unplaced, key=unplaced.__getitem__):
            self._place_somewhere(model, now)

    def _stays_long(self, model: str, samples: int, holders: list[WorkerHandle], now: float) -> bool:
        """Whether `model`'s queue has been long for LONG_FOR_S with every executor that serves it busy."""
        long = samples > LONG_QUEUE_BATCHES * self.config.models[model].max_batch_size and not any(
            (model, w.index) in self.pending for w in holders) and all(
            e.inflight for w in holders for e in w.executors)
        if not long:
            self._long_since.pop(model, None)
            return False
        since = self._long_since.setdefault(model, now)
        if now - since < LONG_FOR_S:
            return False
        del self._long_since[model]
        return True

    def _place_somewhere(self, model: str, now: float, evict: bool = True) -> PendingLoad | None:
        """Place `model` on a ready worker loading nothing else, where it fits with the fewest unloads (none
        unless `evict`); refuse it where it fits on none even alone. None when no worker can take it now."""
        loading = {index for _, index in self.pending}
        # One load at a time per worker: loads queued behind one another would each have taken their room
        # at once, from models used a moment ago, for models whose turn is seconds away.
        candidates = [w for w in self.workers.device_workers
                      if w.state == WorkerState.READY and model not in w.placed and w.index not in loading]
        if not candidates:
            return None
        need = self._need(model)
        too_big = self._too_big(need) if model in self.sizes else None
        if too_big is not None:
            self._refuse(model, too_big, [reply for reply, _ in self._asked.pop(model, [])])
            return None
        options = []
        for worker in candidates:
            # An estimate that fits nowhere may be wrong: the model is loaded where it has the most room.
            unload = self._room(worker, model, min(need, self.budget - self._always_held(worker)))
            if unload is not None and (evict or not unload):
                options.append((len(unload), len(worker.placed), worker.index, worker, unload))
        if not options:
            return None
        *_, worker, unload = min(options, key=lambda option: option[:3])
        for other in unload:
            self._take_off(worker, other, f"to make room for {model}")
        return self._place(worker, model, now)

    def _too_big(self, size: int) -> str | None:
        """Why a model of `size` bytes fits on no worker beside the models every worker holds; None if it fits."""
        budget = self.budget
        devices = self.workers.device_workers
        if not budget or any(size <= budget - self._always_held(w) for w in devices):
            return None
        held = min(self._always_held(w) for w in devices)
        return (f"it holds {size / 2**20:.2f} MiB, more than workers.model_memory_mb ({budget / 2**20:g} MiB) "
                f"leaves beside the models every worker holds ({held / 2**20:.2f} MiB)")

    def _need(self, model: str) -> int:
        """Bytes `model` is expected to hold once loaded: as measured at its last load, else its file's size
        (its weights, as saved)."""
        known = self.sizes.get(model)
        if known is not None:
            return known
        try:
            return model_file(self.config.models[model].repository or "", self.live[model]).stat().st_size
        except (RepositoryError, OSError):
            return 0  # the load will say what is wrong

    def _always_held(self, worker: WorkerHandle) -> int:
        return sum(loaded.memory for (model, _), loaded in worker.loaded.items() if not self._on_demand(model))

    def _held(self, worker: WorkerHandle) -> int:
        """Bytes the models of `worker` hold, those it is loading counted at their expected size."""
        loading = sum(self._need(model) for model, index in self.pending if index == worker.index)
        return worker.model_memory + loading

    def _room(self, worker: WorkerHandle, model: str, need: int) -> list[str] | None:
        """The on-demand models to unload from `worker` so that `model` fits its budget, in the order they go:
        idle ones only (nothing waits for or runs on them), a copy held elsewhere too first, then the least
        recently used. None when no such choice makes room."""
        budget = self.budget
        if not budget:
            return []
        free = budget - self._held(worker)
        unload: list[str] = []
        for other in self._idle(worker, model):
            if free >= need:
                break
            unload.append(other)
            free += sum(loaded.memory for (name, _), loaded in worker.loaded.items() if name == other)
        return unload if free >= need else None

    def _idle(self, worker: WorkerHandle, keep: str) -> list[str]:
        idle = [model for model in worker.placed if model != keep and (model, worker.index) not in self.pending
                and not self.queue.depth(model) and not self.dispatcher.running(worker, model)]

        def copied(model: str) -> bool:
            return any(model in w.placed for w in self.workers.workers if w is not worker)

        return sorted(idle, key=lambda model: (not copied(model), worker.placed[model]))

    def _place(self, worker: WorkerHandle, model: str, now: float) -> PendingLoad:
        self.workers.place(worker, model, now)
        pending = self.pending[(model, worker.index)] = PendingLoad(worker, now)
        pending.replies += [reply for reply, _ in self._asked.pop(model, [])]
        log.info("loading %s %s on worker%d (on demand)", model, self.live[model], worker.index)
        self.reloads.catch_up(worker)
        return pending

    def _take_off(self, worker: WorkerHandle, model: str, why: str) -> None:
        self.workers.unplace(worker, model)
        self.reloads.retire_from(worker, model)
        self.stats.load_series(model).unloads += 1
        log.info("unloading %s from worker%d (%s)", model, worker.index, why)

    def _refuse(self, model: str, error: str, replies: list[Reply] | None) -> None:
        """`model` cannot be loaded now: its waiting requests (and `replies`) are answered with why, and new
        ones are refused until its backoff passes."""
        now = time.monotonic()
        last = self._failure(model)
        backoff = FIRST_BACKOFF_S if last is None else min(MAX_BACKOFF_S, last.backoff_s * 2)
        self.failures[model] = LoadFailure(error, now + backoff, backoff, self.live[model])
        self.stats.load_series(model).failed += 1
        sentence = self._sentence(model, error, backoff)
        log.error("%s", sentence)
        for reply in replies or ():
            reply.fail(sentence)
        if not any(model in w.placed for w in self.workers.workers):
            for request in self.queue.remove_model(model):
                self.replies.error(request, protocol.UNAVAILABLE, sentence)

    def _caught_up(self, worker: WorkerHandle, model: str, error: str | None) -> None:
        """The reload manager's word on a live version loaded on `worker` (error None) or refused."""
        for reply, asked in self._awaiting.pop(model, []):
            if error is None:
                reply.finish({"model": model, "version": self.live[model], "workers": [worker.index],
                              "loaded": True, "load_s": round(time.monotonic() - asked, 3)})
            else:
                reply.fail(f"worker{worker.index} cannot load {model} {self.live[model]}: {error}")
        pending = self.pending.pop((model, worker.index), None)
        if pending is None:
            return
        now = time.monotonic()
        if error is not None:
            self.workers.unplace(worker, model)
            self._refuse(model, error, pending.replies)
            return
        version = self.live[model]
        loaded = worker.loaded.get((model, version))
        if loaded is not None:
            self.sizes[model] = loaded.memory
            too_big = self._too_big(loaded.memory)
            if too_big is not None:
                self._take_off(worker, model, "too big for the budget")
                self._refuse(model, too_big, pending.replies)
                return
        self.failures.pop(model, None)
        series = self.stats.load_series(model)
        series.loads += 1
        series.load_time.add(now - pending.asked)
        waited = [now - request.received for level in self.queue.lanes[model].levels for request in level]
        series.waited.add_all(waited)
        log.info("%s %s loaded on worker%d in %.2f s (on demand); %d request(s) waited for it", model, version,
                 worker.index, now - pending.asked, len(waited))
        for reply in pending.replies:
            reply.finish({"model": model, "version": version, "workers": [worker.index], "loaded": True,
                          "load_s": round(now - pending.asked, 3)})
        budget = self.budget
        if budget:  # it may hold more than its estimate: idle others make room again
            for other in self._idle(worker, model):
                if worker.model_memory <= budget:
                    break
                self._take_off(worker, other, f"{model} holds more than expected")

    def on_worker_exit(self, worker: WorkerHandle) -> None:
        """A worker died: the loads it had under way are asked again elsewhere, by the requests still waiting."""
        for (model, index), pending in list(self.pending.items()):
            if index == worker.index:
                del self.pending[(model, index)]
                for reply in pending.replies:
                    reply.fail(f"worker{worker.index} died while loading {model}")

    # -- commands -----------------------------------------------------------------

    def load(self, model: str, reply: Reply) -> None:
        """`inferctl load`: make sure a worker has `model`'s live version; answer once one has it."""
        version = self.live[model]
        serving = [w.index for w in self.workers.workers if w.serves(model, version)]
        if serving:
            reply.finish({"model": model, "version": version, "workers": serving, "loaded": False})
            return
        pending = next((p for (name, _), p in self.pending.items() if name == model), None)
        if pending is None:
            if not self._on_demand(model):
                if any((model, version) in w.loading for w in self.workers.workers):  # added by a rescan
                    reply.progress(f"every worker is loading {model} {version}",
                                   wait_s=self.config.workers.load_timeout_s)
                    self._awaiting.setdefault(model, []).append((reply, time.monotonic()))
                else:
                    reply.fail(f"no ready worker has {model} {version}; see inferctl status")
                return
            self.failures.pop(model, None)  # asked for by name: tried now, whatever the backoff says
            pending = self._place_somewhere(model, time.monotonic())
            if pending is None:
                failure = self.failures.get(model)
                if failure is not None:
                    reply.fail(self._sentence(model, failure.error, failure.backoff_s))
                else:  # every worker is loading another model, or has no idle one to unload: its turn comes
                    reply.progress(f"waiting for a worker free to load {model} {version} (each loads one model "
                                   "at a time, and unloads only idle ones)", wait_s=self.config.workers.load_timeout_s)
                    self._asked.setdefault(model, []).append((reply, time.monotonic()))
                return
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
        loading = [index for name, index in self.pending if name == model]
        if loading:  # its load's answer (an inferctl load waits for it) would be lost under the unload
            raise ValueError(f"{model} is loading on worker{loading[0]}; it is unloaded only once loaded: try again "
                             "then")
        for worker in holders:
            self._take_off(worker, model, "asked by inferctl unload")
        return {"model": model, "workers": [w.index for w in holders]}
