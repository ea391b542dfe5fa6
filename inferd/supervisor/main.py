"""The supervisor: one loop that owns every socket, the queue, the arenas and the workers.

    clients ──▶ Frontend (ROUTER) ──▶ BatchQueue ──▶ Dispatcher ──▶ arena slot + RunBatch ──▶ worker
    clients ◀── Frontend.reply ◀──── Dispatcher.on_result ◀──────── BatchDone ◀──────────── worker

Signal handlers only queue the signal; the loop wakes on a self-pipe and calls
`handle_<signal>`. The loop blocks on one poller whose timeout is the nearest
batching or deadline event, or the housekeeping tick: an idle daemon sleeps.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket as pysocket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from inferd import __version__, paths, protocol
from inferd.config import Config
from inferd.ipc import messages
from inferd.ipc.arena import Arena, arena_name, owner_alive, sweep_stale
from inferd.repository import LiveVersions, RepositoryError, describe_versions, resolve_version
from inferd.supervisor.batcher import BatchQueue, ModelPolicy
from inferd.supervisor.control import ControlReply, ControlServer, deferred
from inferd.supervisor.devices import resolve_devices
from inferd.supervisor.dispatch import Dispatcher, slot_bytes_needed
from inferd.supervisor.frontend import Frontend
from inferd.supervisor.reload import ReloadManager
from inferd.supervisor.workers import FAILED, READY, STOP_TIMEOUT_S, WorkerHandle, WorkerTable
from inferd.systemd import notify

log = logging.getLogger("inferd.supervisor")

STARTING, SERVING, DRAINING, STOPPING = "starting", "serving", "draining", "stopping"
TICK_S = 0.5
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNAL_NAMES = {s: s.name[3:].lower() for s in SIGNALS}


class StartupError(Exception):
    """The daemon cannot start; the message says why in one sentence."""


def _backend_endpoint(config: Config) -> tuple[str, Path]:
    control = config.server.control or ""
    folder = Path(control[len("ipc://"):]).parent if control.startswith("ipc://") else paths.runtime_dir()
    path = folder / f"inferd-{os.getpid()}-backend.sock"
    return f"ipc://{path}", path


def _sweep_stale_backends(folder: Path) -> None:
    for path in folder.glob("inferd-*-backend.sock"):
        pid = path.name.split("-")[1]
        try:
            created = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if pid.isdigit() and not owner_alive(int(pid), created):
            path.unlink(missing_ok=True)


class Supervisor:
    """The daemon's main process."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = STARTING
        self.started = time.monotonic()
        self.live: dict[str, str] = {}
        self.context = zmq.Context()
        self.poller = zmq.Poller()
        self.arenas: list[Arena] = []
        self.frontend: Frontend | None = None
        self.control: ControlServer | None = None
        self.workers: WorkerTable | None = None
        self.dispatcher: Dispatcher | None = None
        self.reload: ReloadManager | None = None
        self.backend: zmq.Socket | None = None
        self.backend_path: Path | None = None
        self.queue = BatchQueue(
            config.queue.max_size,
            {name: ModelPolicy(m.max_batch_size, m.max_wait_ms / 1000) for name, m in config.models.items()},
        )
        self.exit_code = 0
        self._signals: deque[int] = deque()
        self._callbacks: deque[Callable[[], None]] = deque()
        self._wakeup_r, self._wakeup_w = pysocket.socketpair()
        self._sentinels: dict[int, WorkerHandle] = {}
        self._deadline = 0.0
        self._next_tick = 0.0
        self._done = False

    # -- life cycle -------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until stopped, clean up; return the process exit code."""
        try:
            self._start()
            self._loop()
        except StartupError as exc:
            log.error("%s", exc)
            self.exit_code = 1
        finally:
            self._cleanup()
        return self.exit_code

    def _start(self) -> None:
        config = self.config
        for name in sweep_stale():
            log.info("removed arena %s of a supervisor that is gone", name)
        state = LiveVersions(config.server.state_dir)
        saved, previous = state.load()
        try:
            self.live = {name: resolve_version(m, saved.get(name)) for name, m in config.models.items()}
        except RepositoryError as exc:
            raise StartupError(f"cannot resolve model versions: {exc}") from None
        devices = resolve_devices(config.workers.devices)
        size = config.workers.shm_mb << 20
        try:
            for index in range(len(devices)):
                self.arenas.append(Arena.create(arena_name(os.getpid(), index), size))
        except (OSError, Exception) as exc:
            raise StartupError(f"cannot create the shared-memory arenas: {exc}") from None

        endpoint, self.backend_path = _backend_endpoint(config)
        self.backend_path.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale_backends(self.backend_path.parent)
        self.backend = self.context.socket(zmq.ROUTER)
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.backend.linger = 0
        self.backend.bind(endpoint)
        os.chmod(self.backend_path, 0o600)

        self.frontend = Frontend(self.context, config, self.queue)
        self.frontend.live = self.live
        try:
            self.control = ControlServer(self.context, config.server.control, self, self.frontend)
            self.frontend.bind()
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind: {exc.strerror}") from None
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self.workers = WorkerTable(config, self.backend, endpoint, self.arenas, devices)
        self.workers.versions = self.live
        self.dispatcher = Dispatcher(config, self.workers, self.frontend, self.live)
        self.reload = ReloadManager(config, self.workers, self.dispatcher, self.live,
                                    {m: v for m, v in previous.items() if m in self.live}, state,
                                    self.call_soon_threadsafe)

        self._install_signals()
        for sock in [*self.frontend.sockets, self.control.socket, self.backend]:
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self._wakeup_r.fileno(), zmq.POLLIN)
        # What exists now lives as long as the daemon; keep it out of every later collection.
        gc.freeze()
        now = time.monotonic()
        for worker in self.workers.workers:
            self.workers.spawn(worker, now)
            self._watch(worker)
        log.info("inferd %s starting: pid %d, models %s", __version__, os.getpid(),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))

    def _loop(self) -> None:
        while not self._done:
            now = time.monotonic()
            wait = min(self.queue.next_wakeup(now) or TICK_S, max(0.0, self._next_tick - now))
            events = self.poller.poll(int(wait * 1000) + (wait > 0))
            # Signals first: a request that arrives with a SIGTERM is already refused.
            for target, _ in sorted(events, key=lambda event: event[0] != self._wakeup_r.fileno()):
                self._on_readable(target)
            now = time.monotonic()
            for request in self.queue.expire(now):
                self.frontend.reply_error(request, protocol.TIMEOUT, "the deadline passed before the request ran")
            self._dispatch()
            if now >= self._next_tick:
                self._next_tick = now + TICK_S
                self._housekeeping(now)

    def _on_readable(self, target: Any) -> None:
        if target is self.backend:
            self._on_backend()
        elif target is self.control.socket:
            self.control.on_readable()
        elif target == self._wakeup_r.fileno():
            self._on_wakeup()
        elif target in self._sentinels:
            self._on_worker_exit(self._sentinels[target])
        else:
            self.frontend.on_readable(target)

    def _dispatch(self) -> None:
        now = time.monotonic()
        while True:
            batch = self.queue.take(self.dispatcher.capacity, now)
            if batch is None:
                return
            self.dispatcher.dispatch(*batch)

    def _housekeeping(self, now: float) -> None:
        self.workers.housekeeping(now, respawn=self.state in (STARTING, SERVING))
        for worker in self.workers.workers:
            if worker.process is not None and worker.process.sentinel not in self._sentinels:
                self._watch(worker)
        if self.state == STARTING:
            self._check_started()
        elif self.state == DRAINING:
            if len(self.queue) == 0 and not self.dispatcher.inflight:
                self._stop_workers()
            elif now >= self._deadline:
                log.warning("drain timeout passed; stopping with work left")
                self._force_stop(now)
        elif self.state == STOPPING and all(w.process is None for w in self.workers.workers):
            self._done = True
        self._update_refusal()

    def _check_started(self) -> None:
        workers = self.workers.workers
        if any(w.state not in (READY, FAILED) for w in workers):
            return
        if all(w.state == FAILED for w in workers):
            errors = {w.last_error for w in workers if w.last_error}
            raise StartupError(f"no worker could start: {'; '.join(sorted(errors)) or 'see the log above'}")
        self.state = SERVING
        notify("READY=1")
        failed = [w.index for w in workers if w.state == FAILED]
        if failed:
            log.warning("serving without worker(s) %s, which failed to start", failed)
        log.info("ready: %d worker(s) serving %s", len(workers) - len(failed),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))

    def _update_refusal(self) -> None:
        if self.state == STARTING:
            refusal = "the daemon is starting"
        elif self.state in (DRAINING, STOPPING):
            refusal = "the daemon is shutting down"
        elif not any(w.state == READY for w in self.workers.workers):
            refusal = "no worker is ready; they are restarting"
        else:
            refusal = None
        self.frontend.refusal = refusal

    # -- workers ----------------------------------------------------------------

    def _watch(self, worker: WorkerHandle) -> None:
        sentinel = worker.process.sentinel
        self._sentinels[sentinel] = worker
        self.poller.register(sentinel, zmq.POLLIN)

    def _on_worker_exit(self, worker: WorkerHandle) -> None:
        sentinel = worker.process.sentinel
        self.poller.unregister(sentinel)
        del self._sentinels[sentinel]
        reason = self.workers.reap(worker, time.monotonic(), retry=self.state == SERVING)
        self.dispatcher.fail_worker(worker, f"worker{worker.index} died ({reason}) while running the batch")
        self.reload.on_worker_exit(worker)
        if self.state == STARTING:
            self._check_started()
        elif self.state == STOPPING and all(w.process is None for w in self.workers.workers):
            self._done = True
        self._update_refusal()

    def _on_backend(self) -> None:
        while True:
            try:
                identity, payload = self.backend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            try:
                message = messages.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("malformed message from a worker socket ignored")
                continue
            if isinstance(message, (messages.BatchDone, messages.BatchFailed)):
                executor = self.workers.executor_of(identity)
                if executor is not None:
                    self.dispatcher.on_result(executor, message)
                    if self.reload.retiring:
                        self.reload.retire_idle()
                continue
            if isinstance(message, (messages.VersionLoaded, messages.VersionFailed)):
                sender = self.workers.worker_of(identity)
                if sender is not None:
                    self.reload.on_message(sender, message)
                continue
            worker = self.workers.on_message(identity, message)
            if worker is not None:
                self._on_worker_ready(worker)

    def _on_worker_ready(self, worker: WorkerHandle) -> None:
        for (name, _), loaded in worker.loaded.items():
            needed = slot_bytes_needed(self.config, name, loaded.outputs)
            if needed > worker.slots.slot_size:
                worker.last_error = (
                    f"a full batch of {name} needs {needed / 2**20:.1f} MiB of arena slot but a slot has "
                    f"{worker.slots.slot_size / 2**20:.1f} MiB (workers.shm_mb / (2 x workers.streams)); "
                    "raise workers.shm_mb or lower max_batch_size"
                )
                log.error("worker%d: %s", worker.index, worker.last_error)
                self.workers.stop(worker, give_up=True)
                return
        self.reload.catch_up(worker)
        if self.state == STARTING:
            self._check_started()
        self._update_refusal()

    def _stop_workers(self) -> None:
        self.state = STOPPING
        for worker in self.workers.workers:
            self.workers.stop(worker)

    def _force_stop(self, now: float) -> None:
        for request in self.queue.drain():
            self.frontend.reply_error(request, protocol.UNAVAILABLE, "the daemon stopped before the request ran")
        for worker in self.workers.workers:
            self.dispatcher.fail_worker(worker, "the daemon stopped before the request finished", protocol.UNAVAILABLE)
        self._stop_workers()

    # -- signals ----------------------------------------------------------------

    def _install_signals(self) -> None:
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        for signum in SIGNALS:
            signal.signal(signum, self._queue_signal)

    def _queue_signal(self, signum: int, frame: object) -> None:
        # Handlers run between any two bytecodes: no logging, no I/O, only queue it.
        self._signals.append(signum)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread; any thread may call this."""
        self._callbacks.append(callback)
        try:
            self._wakeup_w.send(b"\0")
        except BlockingIOError:
            pass  # the loop has wake-ups pending already

    def _on_wakeup(self) -> None:
        try:
            while self._wakeup_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._signals:
            getattr(self, f"handle_{SIGNAL_NAMES[self._signals.popleft()]}")()
        while self._callbacks:
            self._callbacks.popleft()()

    def handle_term(self) -> None:
        """SIGTERM: stop taking requests, finish the queued ones, exit; a second one hurries."""
        now = time.monotonic()
        if self.state in (STARTING, SERVING):
            log.info("stopping: finishing %d queued and %d running batch(es), at most %g s",
                     len(self.queue), len(self.dispatcher.inflight), self.config.server.drain_timeout_s)
            self.state = DRAINING
            notify("STOPPING=1")
            self._deadline = now + self.config.server.drain_timeout_s
            self._next_tick = now
        elif self.state == DRAINING:
            log.warning("second stop signal: answering what is left `unavailable`")
            self._force_stop(now)
        self._update_refusal()

    handle_int = handle_term

    def handle_hup(self) -> None:
        """SIGHUP: re-reading the config while running is not supported yet; say so."""
        log.warning("SIGHUP received: live config reload is not supported yet; nothing changed")

    # -- control commands ---------------------------------------------------------

    def command_health(self) -> dict[str, Any]:
        """Ready to serve: accepting requests, and every model live on a ready worker."""
        if self.state != SERVING:
            return {"healthy": False, "reason": f"the daemon is {self.state}"}
        for name, version in self.live.items():
            if not any(w.serves(name, version) for w in self.workers.workers):
                return {"healthy": False, "reason": f"no ready worker serves {name} {version}"}
        return {"healthy": True, "reason": "serving"}

    def command_status(self) -> dict[str, Any]:
        """The daemon's state, its workers and the live version of each model."""
        return {
            "pid": os.getpid(),
            "version": __version__,
            "state": self.state,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "listen": list(self.config.server.listen),
            "models": {
                name: {
                    "live_version": version,
                    "previous_version": self.reload.previous.get(name),
                    "reloading_to": self.reload.active[name].version if name in self.reload.active else None,
                    "queue_depth": self.queue.depth(name),
                }
                for name, version in self.live.items()
            },
            "workers": [
                {
                    "worker": w.index,
                    "pid": w.pid,
                    "device": w.device,
                    "state": w.state,
                    "generation": w.generation,
                    "restarts": w.restarts,
                    "batches": w.batches,
                    "busy_executors": sum(1 for e in w.executors if e.inflight),
                    "loaded": sorted(f"{m} {v}" for m, v in w.loaded),
                    "last_error": w.last_error or None,
                }
                for w in self.workers.workers
            ],
            "replies": dict(self.frontend.replies),
            "undelivered_replies": self.frontend.undelivered,
        }

    @deferred
    def command_reload(self, reply: ControlReply, version: str, model: str | None = None,
                       allow_signature_change: bool = False) -> None:
        """Blue-green: load `version` beside the live one on every worker, then flip; answer when done."""
        self.reload.start(self._model(model), version, allow_signature_change, reply)

    @deferred
    def command_rollback(self, reply: ControlReply, model: str | None = None) -> None:
        """Blue-green back to the version live before the last reload."""
        name = self._model(model)
        previous = self.reload.previous.get(name)
        if previous is None:
            reply.fail(f"{name} has not been reloaded; there is nothing to roll back to")
            return
        self.reload.start(name, previous, True, reply)

    def command_versions(self, model: str | None = None) -> dict[str, Any]:
        """The versions in each repository, with file sizes and dates, and which is live."""
        names = [self._model(model)] if model is not None or len(self.live) == 1 else sorted(self.live)
        result = {}
        for name in names:
            try:
                found = describe_versions(self.config.models[name].repository)
            except RepositoryError as exc:
                raise ValueError(str(exc)) from None
            for entry in found:
                entry["live"] = entry["version"] == self.live[name]
            result[name] = found
        return result

    def _model(self, model: str | None) -> str:
        """The model a command is about: the one named, or the only one served."""
        if model is None:
            if len(self.live) == 1:
                return next(iter(self.live))
            raise ValueError(f"this daemon serves several models ({', '.join(sorted(self.live))}); name one with --model")
        if model not in self.live:
            raise ValueError(f"unknown model {model!r}; this daemon serves {', '.join(sorted(self.live))}")
        return model

    # -- cleanup ----------------------------------------------------------------

    def _cleanup(self) -> None:
        """Release everything this process made, whatever state it got to."""
        if self.reload is not None:
            self.reload.close()
        if self.workers is not None:
            for worker in self.workers.workers:
                if worker.process is not None and worker.process.exitcode is None:
                    self.workers.stop(worker)
            self.workers.wait_all(STOP_TIMEOUT_S)
        if self.frontend is not None:
            self.frontend.close()
        if self.control is not None:
            self.control.close()
        if self.backend is not None:
            self.backend.close(linger=0)
            self.backend_path.unlink(missing_ok=True)
        for arena in self.arenas:
            arena.close()
            arena.unlink()
        self.context.term()
        signal.set_wakeup_fd(-1)
        self._wakeup_r.close()
        self._wakeup_w.close()
        log.info("stopped")
