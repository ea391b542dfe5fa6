"""Blue-green reload: load a version beside the live one everywhere, then flip in one step.

    reload V ──▶ LoadVersion(V) to every ready worker ──▶ all VersionLoaded ──▶ live[model] = V (saved)
                                     │ any VersionFailed, a worker death,          │
                                     │ a load past workers.load_timeout_s          ▼
                                     ▼                                  old version unloaded on each
                 UnloadVersion(V) where it loaded; the old version     worker once its last batch is back
                 serves on (a worker whose load hung is replaced)

Batches already sent finish on the version they were sent with; every batch
formed after the flip uses V. The flip waits until every ready worker that
serves the model has V: a worker that came up during the reload (with the old
version) is asked to load V too. A worker that starts after the flip comes up
with the old version and is brought to the live one ("catch-up") before it
gets that model's batches.

A trial (canary.py) loads its candidate the same way, with `on_loaded` in place
of the flip; the candidate then stays loaded, and is caught up to, like a live
version, until its trial ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.models import model_files
from inferd.models.repository import RepositoryError, SavedVersions, kind_change, model_file
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.processes.workers import WorkerHandle, WorkerState, WorkerTable
from inferd.supervisor.shared.candidates import Candidates
from inferd.supervisor.shared.command_replies import Reply
from inferd.supervisor.shared.live import LiveVersions
from inferd.system.systemd import Systemd

log = logging.getLogger("inferd.reload")


@dataclass(eq=False)
class Reload:
    """One reload of one model, from its start to its flip or its refusal."""

    model: str
    version: str
    previous: str
    expect: tuple[messages.TensorSpec, ...] | None
    reply: Reply
    started: float
    pending: set[WorkerHandle]
    loaded: dict[WorkerHandle, messages.VersionLoaded] = field(default_factory=dict)
    failure: str | None = None
    on_loaded: Callable[[Reload], None] | None = None  # a trial's start, instead of the flip

    def timings(self) -> dict[str, float]:
        """The slowest worker's load and warm-up, in seconds."""
        return {"load_s": round(max(m.load_s for m in self.loaded.values()), 3),
                "warm_s": round(max(m.warm_s for m in self.loaded.values()), 3)}


def _waiting(reload: Reload) -> bool:
    """Whether `reload` waits for a worker to come back (none served its model when it began)."""
    return not reload.pending and not reload.loaded and reload.failure is None


class ReloadManager:
    """Runs reloads and rollbacks, keeps every worker on the live versions, and is the one writer of them."""

    def __init__(self, config: Config, workers: WorkerTable, dispatcher: Dispatcher, live: LiveVersions,
                 candidates: Candidates, saved: SavedVersions, systemd: Systemd,
                 call_soon_threadsafe: Callable[[Callable[[], None]], None]) -> None:
        self.config = config
        self.candidates = candidates
        self.systemd = systemd
        # Told when a worker cannot load a candidate it was catching up to (the canary manager ends the trial).
        self.on_candidate_failed: Callable[[str, str, str], None] = lambda model, version, why: None
        # Told when a worker's catch-up to a live version ended: (worker, model, None) loaded, or the error.
        self.on_caught_up: Callable[[WorkerHandle, str, str | None], None] = lambda worker, model, error: None
        # fsync takes milliseconds, sometimes tens: never on the loop that serves requests.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._call_soon_threadsafe = call_soon_threadsafe
        self.workers = workers
        self.dispatcher = dispatcher
        self.live = live
        self.saved = saved
        self.active: dict[str, Reload] = {}
        # Versions waiting to be unloaded from a worker once its last batch of them is back.
        self.retiring: set[tuple[WorkerHandle, str, str]] = set()
        # Loads that bring a worker to the live version outside any reload.
        self.catching_up: set[tuple[WorkerHandle, str, str]] = set()
        self._deprecation_said: set[tuple[str, str]] = set()
        for model, version in live.items():
            self._say_if_deprecated(model, version, config.models[model].repository)

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): model configs, the memory guard, the load timeout."""
        self.config = config

    def add_model(self, model: str, version: str, repository: str | None) -> None:
        """Serve a model a config reload added (its repository in the new config), at `version`; every ready
        worker catches up to it."""
        self.live.add(model, version)
        self._say_if_deprecated(model, version, repository)

    def _say_if_deprecated(self, model: str, version: str, repository: str | None) -> None:
        """Log, once per version, that a live TorchScript version will stop loading one day, and how to convert it."""
        if (model, version) in self._deprecation_said:
            return
        try:
            found = model_files.inspect(model_file(repository or "", version))
        except RepositoryError:
            return
        if found.format == model_files.TORCHSCRIPT:
            self._deprecation_said.add((model, version))
            log.warning("%s %s is TorchScript, which PyTorch has deprecated (torch.jit.load warns; a coming release "
                        "will not load it): `inferd convert --config PATH --model %s --from %s --to NEW` makes an "
                        "exported or AOTInductor version of it", model, version, model, version)

    def start(self, model: str, version: str, allow_signature_change: bool, reply: Reply,
              on_loaded: Callable[[Reload], None] | None = None) -> None:
        """Begin a reload of `model` to `version` (with `on_loaded`, a trial's load, which does not flip);
        refusals answer `reply` at once."""
        if model in self.active:
            reply.fail(f"a reload of {model} (to {self.active[model].version}) is already running; wait for it")
            return
        candidate = self.candidates.get(model)
        if candidate is not None:
            reply.fail(f"{model} has a {candidate.describe()}; promote it or roll it back first")
            return
        live = self.live[model]
        if version == live:
            if on_loaded is not None:
                reply.fail(f"{model} {version} is already live; a trial needs another version")
            else:  # asked twice (a script run again): the outcome it wants holds
                reply.finish({"model": model, "version": version, "already_live": True})
            return
        try:
            model_file(self.config.models[model].repository or "", version)
        except RepositoryError as exc:
            reply.fail(f"cannot reload {model}: {exc}")
            return
        misfit = kind_change(model, self.config.models[model], live, version)
        if misfit is not None:
            reply.fail(f"cannot reload {model}: {misfit}")
            return
        targets = {w for w in self.workers.workers if w.serves(model, live)}
        now = time.monotonic()
        if not targets and self.config.models[model].on_demand and \
                not any(model in w.placed for w in self.workers.workers):
            if on_loaded is not None:
                reply.fail(f"{model} is loaded on no worker, so nothing would compare {version} with it; "
                           f"`inferctl load --model {model}` first")
                return
            # Loaded nowhere: the version becomes live now, and loads where the next request needs it.
            self.flip(model, version, reply, now, "reload", {"loaded_on": 0})
            return
        coming = sorted((back, w.index) for w in self.workers.workers if w.state != WorkerState.READY
                        and self._holds(w, model) and (back := w.expected_back(now)) is not None)
        if not targets and not coming:
            reply.fail(f"no ready worker serves {model}, and none is coming back; nothing can load {version}")
            return
        expect = None if allow_signature_change else self.workers.signature(model, live)
        # A version reloaded soon after it was replaced may still be waiting to be
        # unloaded; it is wanted again, and an unload sent after this load would undo it.
        self.retiring = {r for r in self.retiring if r[1:] != (model, version)}
        reload = Reload(model, version, live, expect, reply, time.monotonic(), set(), on_loaded=on_loaded)
        self.active[model] = reload
        self.systemd.changing()
        log.info("reloading %s: %s -> %s on %d worker(s)", model, live, version, len(targets))
        if not targets:  # its workers are restarting: it loads on the first one back (catch_up)
            back, index = coming[0]
            reply.progress(f"no worker serves {model} now: waiting for {self.workers.workers[index].name}, expected "
                           f"back in {max(0.0, back - now):.1f} s, to load {version}",
                           wait_s=self.config.workers.load_timeout_s)
            return
        reply.progress(f"loading {model} {version} beside {live} on {len(targets)} worker(s)",
                       wait_s=self.config.workers.load_timeout_s)
        for worker in targets:
            self._load(reload, worker)
        self._settle(reload)

    def _load(self, reload: Reload, worker: WorkerHandle) -> None:
        if self.workers.load(worker, reload.model, reload.version, reload.expect, time.monotonic()):
            reload.pending.add(worker)
        elif reload.failure is None:
            reload.failure = f"{worker.name} cannot be reached"

    def on_message(self, worker: WorkerHandle, message: messages.VersionLoaded | messages.VersionFailed) -> None:
        """A worker finished loading a version (or could not)."""
        version = message.loaded.version if isinstance(message, messages.VersionLoaded) else message.version
        self.workers.load_answered(worker, message.model, version)
        key = (worker, message.model, version)
        if key in self.catching_up:
            self.catching_up.discard(key)
            self._caught_up(worker, message)
            return
        reload = self.active.get(message.model)
        if reload is None or reload.version != version or worker not in reload.pending:
            return
        reload.pending.discard(worker)
        if isinstance(message, messages.VersionLoaded):
            reload.loaded[worker] = message
            problem = self.workers.version_loaded(worker, message.model, message.loaded)
            if problem is not None and reload.failure is None:
                reload.failure = problem
            reload.reply.progress(
                f"{worker.name}: loaded in {message.load_s:.2f} s, warmed up in {message.warm_s:.2f} s"
            )
        elif reload.failure is None:
            reload.failure = f"{worker.name} refused {message.model} {version}: {message.error}"
        self._settle(reload)

    def on_worker_exit(self, worker: WorkerHandle) -> None:
        """A worker died: a reload waiting on it is abandoned; its retiring versions are gone with it."""
        self.retiring = {r for r in self.retiring if r[0] is not worker}
        self.catching_up = {c for c in self.catching_up if c[0] is not worker}
        for reload in list(self.active.values()):
            reload.loaded.pop(worker, None)
            if worker in reload.pending:
                reload.pending.discard(worker)
                reload.failure = reload.failure or f"{worker.name} died while loading {reload.version}"
                self._settle(reload)

    def check_loads(self, now: float) -> None:
        """Abandon what waits on a load that outlived workers.load_timeout_s, and replace the worker
        whose loader hung. Such workers are replaced one at a time: the executors of a hung loader
        still serve the live versions, so the others serve on while one is replaced."""
        limit = self.config.workers.load_timeout_s
        for reload in [r for r in self.active.values() if _waiting(r) and now - r.started > limit]:
            reload.failure = (f"no worker serving {reload.previous} came back within workers.load_timeout_s "
                              f"({limit:g} s)")
            self._settle(reload)
        for worker in self.workers.workers:
            late = [key for key, asked in worker.loading.items() if now - asked > limit]
            if not late:
                continue
            model, version = late[0]
            why = f"{worker.name} did not load {model} {version} within workers.load_timeout_s ({limit:g} s)"
            for reload in list(self.active.values()):
                if worker in reload.pending:
                    reload.pending.discard(worker)
                    reload.failure = reload.failure or why
                    self._settle(reload)
            for late_model, late_version in late:
                # A live version's load that hung failed, as one refused does: an on-demand model waits out its
                # backoff, rather than being placed again at once on the worker that replaces this one.
                if (worker, late_model, late_version) in self.catching_up and \
                        self.live.get(late_model) == late_version:
                    self.on_caught_up(worker, late_model, f"{worker.name} did not load {late_model} {late_version} "
                                                          f"within workers.load_timeout_s ({limit:g} s)")
            self.catching_up = {c for c in self.catching_up if c[0] is not worker}
            if not any(w.state in (WorkerState.REPLACING, WorkerState.BOOTING, WorkerState.DEAD)
                       for w in self.workers.workers if w is not worker):
                self.workers.replace(worker, why)

    def catch_up(self, worker: WorkerHandle) -> None:
        """Bring a worker that came up with an old version to the live version of each model; a reload that
        waited for a worker to come back loads there now."""
        if worker.state != WorkerState.READY:
            return
        for reload in [r for r in self.active.values() if _waiting(r) and worker.serves(r.model, r.previous)]:
            self._settle(reload)  # loads it on every ready worker that serves the previous version
        wanted = [*self.live.items(), *((model, c.version) for model, c in self.candidates.items())]
        for model, version in wanted:
            if (model, version) in worker.loaded or (worker, model, version) in self.catching_up or \
                    not self._holds(worker, model):
                continue
            if model in self.active and worker in self.active[model].pending:
                continue
            self.retiring.discard((worker, model, version))
            candidate = self.candidates.get(model)
            expect = None
            if candidate is not None and candidate.version == version and not candidate.allow_signature_change:
                expect = self.workers.signature(model, self.live[model])
            if self.workers.load(worker, model, version, expect, time.monotonic()):
                self.catching_up.add((worker, model, version))
                role = "live version" if self.live.get(model) == version else "candidate"
                log.info("%s: catching up %s to the %s %s", worker.name, model, role, version)

    def retire_idle(self) -> None:
        """Unload each retiring version from workers where its last batch is back.

        Only here is UnloadVersion sent, so no version is freed under a batch
        that still runs on it, nor while it is live or being loaded again.
        """
        for worker, model, version in list(self.retiring):
            if self._wanted(worker, model, version):
                self.retiring.discard((worker, model, version))
            elif not self.dispatcher.has_inflight(worker, model, version):
                self.retiring.discard((worker, model, version))
                self.workers.version_unloaded(worker, model, version)

    def _holds(self, worker: WorkerHandle, model: str) -> bool:
        """Whether `model` belongs on `worker` (an on-demand model only where it is placed, a Python model on its
        own steps)."""
        return self.workers.holds(worker, model)

    def _wanted(self, worker: WorkerHandle, model: str, version: str) -> bool:
        """True for a live version and a candidate where the model belongs, and for one a reload or catch-up
        is loading on `worker`."""
        reload = self.active.get(model)
        candidate = self.candidates.get(model)
        return (
            (self._holds(worker, model) and (self.live.get(model) == version
                                              or (candidate is not None and candidate.version == version)))
            or (reload is not None and reload.version == version)
            or (worker, model, version) in self.catching_up
        )

    def _settle(self, reload: Reload) -> None:
        """Once every worker has answered: flip, or give up and free what was loaded."""
        if not reload.pending and reload.failure is None:
            # Never flip while a ready worker serving the model lacks the new version (one
            # that came up during the reload): it loads it first.
            for worker in self.workers.workers:
                if worker.serves(reload.model, reload.previous) and (reload.model, reload.version) not in worker.loaded:
                    self._load(reload, worker)
                    reload.reply.progress(f"{worker.name} came up during the reload: loading {reload.version} "
                                          "there too", wait_s=self.config.workers.load_timeout_s)
        if reload.pending:
            return
        del self.active[reload.model]
        try:
            self._end(reload)
        finally:
            self.systemd.changed()

    def _end(self, reload: Reload) -> None:
        """A reload every worker has answered: give it up, hand a trial's load to the trial, or flip."""
        if reload.failure is not None or not reload.loaded:
            for worker in reload.loaded:
                self._retire(worker, reload.model, reload.version)
            reason = reload.failure or "no worker loaded it"
            log.error("reload of %s to %s abandoned: %s; %s keeps serving", reload.model, reload.version,
                      reason, reload.previous)
            reload.reply.fail(f"{reload.version} was not made live: {reason}; {reload.previous} keeps serving")
            return
        if reload.on_loaded is not None:
            reload.on_loaded(reload)
            return
        self.flip(reload.model, reload.version, reload.reply, reload.started, "reload", reload.timings())

    def flip(self, model: str, version: str, reply: Reply, started: float, what: str, result: dict[str, Any]) -> None:
        """Make `version` (loaded on every ready worker) live, retire the version it replaces once its last
        batch is back, and answer `reply` with `result` once the new state is on disk."""
        switch_started = time.perf_counter()
        previous = self.live.switch(model, version)
        switch_ms = (time.perf_counter() - switch_started) * 1000
        self._say_if_deprecated(model, version, self.config.models[model].repository)
        for worker in self.workers.workers:
            if (model, previous) in worker.loaded:
                self._retire(worker, model, previous)
            self.catch_up(worker)
        log.info("%s is now %s (was %s), %.2f s after the %s began", model, version, previous,
                 time.monotonic() - started, what)
        reply.progress(f"switched {model} from {previous} to {version} in {switch_ms:.3f} ms")
        result = {"model": model, "version": version, "previous": previous, **result, "switch_ms": round(switch_ms, 3)}
        # The command returns once the new live version is on disk too.
        self.save_then_answer(reply, result, started)

    def _save(self, live: dict[str, str], previous: dict[str, str],
              candidates: dict[str, Any]) -> tuple[float, str | None]:
        """In the writer thread: save, and return (milliseconds it took, error or None)."""
        started = time.perf_counter()
        try:
            self.saved.save(live, previous, candidates)
            error = None
        except OSError as exc:
            error = f"cannot save the live versions to {self.saved.path}: {exc}"
        return (time.perf_counter() - started) * 1000, error

    def save_then_answer(self, reply: Reply, result: dict[str, Any], started: float) -> None:
        """Save the state as it is now, then finish `reply` with `result`, the save's time and the command's."""
        def saved(save_ms: float, error: str | None) -> None:
            if error is not None:
                log.error("%s; a restart would serve the versions saved before", error)
                reply.progress(f"warning: {error}")
            reply.finish({**result, "save_ms": round(save_ms, 3), "total_s": round(time.monotonic() - started, 3)})

        saving = self._writer.submit(self._save, *self.live.snapshot(), self.candidates.snapshot())
        saving.add_done_callback(lambda done: self._call_soon_threadsafe(lambda: saved(*done.result())))

    def close(self) -> None:
        """Wait for the last save to reach the disk."""
        self._writer.shutdown(wait=True)

    def _caught_up(self, worker: WorkerHandle, message: messages.VersionLoaded | messages.VersionFailed) -> None:
        if isinstance(message, messages.VersionFailed):
            candidate = self.candidates.get(message.model)
            if candidate is not None and candidate.version == message.version:
                self.on_candidate_failed(message.model, message.version,
                                         f"{worker.name} cannot load it: {message.error}")
                return
            if self.live.get(message.model) != message.version:  # wanted no more (its trial ended meanwhile)
                return
            log.error("%s cannot load the live %s %s: %s; it will not serve %s",
                      worker.name, message.model, message.version, message.error, message.model)
            self.workers.note_error(worker, message.error)
            self.on_caught_up(worker, message.model, message.error)
            return
        model, version = message.model, message.loaded.version
        problem = self.workers.version_loaded(worker, model, message.loaded)
        if problem is not None:  # a model added by SIGHUP, whose outputs were not known before
            self.workers.version_unloaded(worker, model, version)
            candidate = self.candidates.get(model)
            if candidate is not None and candidate.version == version:
                self.on_candidate_failed(model, version, f"{worker.name} cannot serve it: {problem}")
                return
            log.error("%s; it will not serve %s", problem, model)
            self.workers.note_error(worker, problem)
            self.on_caught_up(worker, model, problem)
            return
        for _, other in [k for k in worker.loaded if k[0] == model]:
            if not self._wanted(worker, model, other):
                self._retire(worker, model, other)
        if self.live.get(model) == version:
            self.on_caught_up(worker, model, None)

    def retire_from(self, worker: WorkerHandle, model: str) -> None:
        """Unload every version of `model` from `worker` (taken off it) once nothing runs on them."""
        for loaded_model, version in list(worker.loaded):
            if loaded_model == model:
                self._retire(worker, model, version)

    def retire_everywhere(self, model: str, version: str) -> None:
        """Unload `version` of `model` from every worker once nothing runs on it and nothing wants it."""
        for worker in self.workers.workers:
            if (model, version) in worker.loaded:
                self._retire(worker, model, version)

    def _retire(self, worker: WorkerHandle, model: str, version: str) -> None:
        """Unload `version` from `worker` as soon as nothing runs on it and nothing wants it."""
        self.retiring.add((worker, model, version))
        self.retire_idle()
