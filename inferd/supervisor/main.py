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
from zmq.auth.thread import ThreadAuthenticator

from inferd import __version__, paths, protocol
from inferd import config as config_module
from inferd.config import Config
from inferd.ipc import messages
from inferd.ipc.arena import Arena, arena_name, owner_alive, sweep_stale
from inferd.ipc.sockets import recv_parts
from inferd.logs import set_level
from inferd.repository import LiveVersions, RepositoryError, resolve_version
from inferd.supervisor import reconfigure
from inferd.supervisor.batcher import BatchQueue, ModelPolicy
from inferd.supervisor.commands import Commands
from inferd.supervisor.control import ControlServer, LoggedReply
from inferd.supervisor.devices import resolve_devices
from inferd.supervisor.dispatch import Batch, Dispatcher, slot_bytes_needed, slot_shortfall
from inferd.supervisor.frontend import Frontend
from inferd.supervisor.metrics import MetricsServer
from inferd.supervisor.probes import Probes
from inferd.supervisor.reload import ReloadManager
from inferd.supervisor.state import DRAINING, SERVING, STARTING, STOPPING
from inferd.supervisor.stats import Stats
from inferd.supervisor.workers import ABORT_GRACE_S, FAILED, READY, STOP_TIMEOUT_S, WorkerHandle, WorkerTable
from inferd.systemd import Watchdog, notify

log = logging.getLogger("inferd.supervisor")

TICK_S = 0.5
REPLY_FLUSH_MS = 1000  # at exit, how long replies still queued to clients may take to leave
SENDING_CHECK_S = 0.001  # how often slots held by replies still being sent are checked
STATUS_EVERY_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNAL_NAMES = {s: s.name[3:].lower() for s in SIGNALS}


class StartupError(Exception):
    """The daemon cannot start; the message says why in one sentence."""


def _backend_endpoint(config: Config) -> tuple[str, Path]:
    control = config.server.control or ""
    folder = Path(control[len("ipc://"):]).parent if control.startswith("ipc://") else paths.runtime_dir()
    path = folder / f"inferd-{os.getpid()}-backend.sock"
    return f"ipc://{path}", path


def _sweep_stale_runtime_files(folder: Path) -> None:
    """Remove backend sockets and stack files of supervisors that are gone."""
    for path in [*folder.glob("inferd-*-backend.sock"), *folder.glob("inferd-*.stacks")]:
        pid = path.name.split("-")[1]
        try:
            created = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if pid.isdigit() and not owner_alive(int(pid), created):
            path.unlink(missing_ok=True)


def _policies(config: Config) -> dict[str, ModelPolicy]:
    return {name: ModelPolicy(m.max_batch_size, m.max_wait_ms / 1000) for name, m in config.models.items()}


class Supervisor:
    """The daemon's main process."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = STARTING
        self.started = time.monotonic()
        self.live: dict[str, str] = {}
        self.saved_live: dict[str, str] = {}
        self.context = zmq.Context()
        if hasattr(os, "SCHED_BATCH"):
            # ZeroMQ's I/O thread, woken by a reply, then does not preempt the loop that sent it:
            # it runs when the loop next waits, or on an idle core, and writes a whole batch of
            # replies in one go instead of costing a context switch each.
            self.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        self.poller = zmq.Poller()
        self.arenas: list[Arena] = []
        self.frontend: Frontend | None = None
        self.control: ControlServer | None = None
        self.workers: WorkerTable | None = None
        self.dispatcher: Dispatcher | None = None
        self.metrics: MetricsServer | None = None
        self.authenticator: ThreadAuthenticator | None = None
        self.reload: ReloadManager | None = None
        self.backend: zmq.Socket | None = None
        self.backend_path: Path | None = None
        self.queue = BatchQueue(config.queue.max_size, _policies(config), config.queue.max_per_client)
        self.stats = Stats(self.started)
        self.probes = Probes()
        self.exit_code = 0
        self._signals: deque[int] = deque()
        self._callbacks: deque[Callable[[], None]] = deque()
        self._wakeup_r, self._wakeup_w = pysocket.socketpair()
        self._sentinels: dict[int, WorkerHandle] = {}
        self._deadline = 0.0
        self._next_tick = 0.0
        self._done = False
        self._watchdog = Watchdog()
        self._spin_s = config.server.spin_us / 1e6
        self._active = False  # the last poll found work: spin before the next blocks
        self._stall: str | None = None
        self._next_status = 0.0
        self._replies_at_status = 0

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
        self.saved_live, previous = state.load()
        try:
            self.live = {name: resolve_version(m, self.saved_live.get(name)) for name, m in config.models.items()}
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
        _sweep_stale_runtime_files(self.backend_path.parent)
        self.backend = self.context.socket(zmq.ROUTER)
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.backend.linger = 0
        self.backend.bind(endpoint)
        os.chmod(self.backend_path, 0o600)

        self.frontend = Frontend(self.context, config, self.queue, self.stats)
        self.frontend.live = self.live
        if config.server.curve_authorized_keys:
            # ZAP: only clients whose public key is in the folder complete the CURVE handshake.
            self.authenticator = ThreadAuthenticator(self.context)
            self.authenticator.start()
            self.authenticator.configure_curve(domain="*", location=config.server.curve_authorized_keys)
        try:
            self.control = ControlServer(self.context, config.server.control, Commands(self), self.frontend)
            self.frontend.bind()
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind: {exc.strerror}") from None
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self.workers = WorkerTable(config, self.backend, endpoint, self.arenas, devices, self.backend_path.parent)
        self.workers.versions = self.live
        self.dispatcher = Dispatcher(config, self.workers, self.frontend, self.live, self.stats)
        self.reload = ReloadManager(config, self.workers, self.dispatcher, self.live,
                                    {m: v for m, v in previous.items() if m in self.live}, state,
                                    self.call_soon_threadsafe)

        if config.server.metrics:
            try:
                self.metrics = MetricsServer(config.server.metrics, self)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics at {config.server.metrics}: {exc.strerror}") from None
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
            queue_wakeup = self.queue.next_wakeup(now)
            wait = min(TICK_S if queue_wakeup is None else queue_wakeup, max(0.0, self._next_tick - now),
                       self._watchdog.wait(now) or TICK_S)
            if self.dispatcher.sending:
                wait = min(wait, SENDING_CHECK_S)
            oldest = self.dispatcher.oldest()
            if oldest is not None:
                wait = min(wait, self._hang_check_in(oldest, now))
            # Requests waiting mean every executor they could use is busy: the loop will be woken
            # by an answer, and the cores are better left to the executors than spun on.
            events = self._poll(wait, spin=self._active and not len(self.queue))
            self._active = bool(events)
            # Signals first: a request that arrives with a SIGTERM is already refused.
            for target, _ in sorted(events, key=lambda event: event[0] != self._wakeup_r.fileno()):
                self._on_readable(target)
            now = time.monotonic()
            for request in self.queue.expire(now):
                self.frontend.reply_error(request, protocol.TIMEOUT, "the deadline passed before the request ran")
            if self.dispatcher.sending:
                self.dispatcher.release_sent()
            self._dispatch()
            if now >= self._next_tick:
                self._next_tick = now + TICK_S
                self._housekeeping(now)
            self._report(now)

    def _hang_check_in(self, batch: Batch, now: float) -> float:
        """Seconds until the longest-running batch needs a look: when it would count as hung,
        or when its hung worker is due for SIGKILL. Once both have passed, the worker's exit wakes the loop."""
        worker = batch.executor.worker
        due = batch.started + self.config.workers.batch_timeout_s if worker.hung is None else \
            worker.hung_since + ABORT_GRACE_S
        return due - now + 0.001 if due >= now else TICK_S

    def _poll(self, wait: float, spin: bool) -> list[tuple[Any, int]]:
        """The sockets and fds that are ready, waiting at most `wait` seconds.

        With `spin` (the last poll found work), the loop polls without sleeping for
        server.spin_us first: a core that went idle (a virtual CPU above all) takes
        far longer to wake than the next request takes to come. Each turn yields the
        core to any other thread that wants it. Otherwise it blocks.
        """
        events = self.poller.poll(0)
        if not events and spin and self._spin_s:
            spin_until = time.monotonic() + self._spin_s
            while not events and time.monotonic() < spin_until:
                os.sched_yield()
                events = self.poller.poll(0)
        return events or self.poller.poll(int(wait * 1000) + (wait > 0))

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
            if len(self.queue) == 0 and not self.dispatcher.inflight and not self.dispatcher.sending:
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
        self.frontend.unserved = {
            name for name, version in self.live.items()
            if not any(w.serves(name, version) for w in self.workers.workers)
        }

    def _report(self, now: float) -> None:
        """Tell systemd we are alive (only while no batch is stuck) and what we are doing."""
        oldest = self.dispatcher.oldest()
        stuck = oldest if oldest is not None and now - oldest.started > self.config.workers.batch_timeout_s else None
        stall = None if stuck is None else (
            f"batch {stuck.id} of {stuck.model} on worker{stuck.executor.worker.index} ran longer than "
            f"workers.batch_timeout_s ({self.config.workers.batch_timeout_s:g} s)")
        changed = stall != self._stall
        if changed:
            if stall:
                log.error("watchdog pings stop: %s", stall)
            else:
                log.info("watchdog pings resume")
            self._stall = stall
        if stuck is not None:
            self.workers.abort_hung(stuck.executor.worker, stall, now)
        else:
            self._watchdog.ping(now)
        if now >= self._next_status or changed:
            replies = sum(self.frontend.replies.values())
            rate = (replies - self._replies_at_status) / (now - self._next_status + STATUS_EVERY_S)
            self._replies_at_status, self._next_status = replies, now + STATUS_EVERY_S
            ready = sum(w.state == READY for w in self.workers.workers)
            notify(f"STATUS={self.state}; {ready}/{len(self.workers.workers)} workers ready; "
                   + ", ".join(f"{n} {v}" for n, v in self.live.items()) + f"; {rate:.0f} requests/s"
                   + (f"; STALLED: {stall}" if stall else ""))

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
        while (parts := recv_parts(self.backend)) is not None:
            if len(parts) != 2:
                continue
            identity, payload = parts[0].bytes, parts[1].buffer
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
                    self._update_refusal()
                continue
            worker = self.workers.on_message(identity, message)
            if worker is not None:
                self._on_worker_ready(worker)

    def _on_worker_ready(self, worker: WorkerHandle) -> None:
        for (name, _), loaded in worker.loaded.items():
            shortfall = slot_shortfall(self.config, name, loaded.outputs, worker.slots.slot_size)
            if shortfall is not None:
                worker.last_error = shortfall
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
        """SIGHUP: re-read the config; apply what can change live, name what needs a restart."""
        notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            self.reconfigure()
        finally:
            notify("READY=1")

    def reconfigure(self) -> None:
        """Re-read the config file and apply it as far as it can be applied while running."""
        if self.config.source is None or self.config.source == "demo":
            log.warning("SIGHUP: the demo has no config file to re-read; nothing changed")
            return
        try:
            new = config_module.load(self.config.source)
        except config_module.ConfigError as exc:
            log.error("SIGHUP: %s has %d problem(s), nothing changed: %s", self.config.source,
                      len(exc.problems), "; ".join(exc.problems))
            return
        plan = reconfigure.plan(self.config, new)
        plan = self._keep_slots_large_enough(plan)
        for name in plan.added_models:
            try:
                self.live[name] = resolve_version(plan.config.models[name], self.saved_live.get(name))
            except RepositoryError as exc:
                log.error("SIGHUP: models.%s cannot be added: %s", name, exc)
                plan.config.models.pop(name)
        self._configure(plan.config)
        for name in plan.version_changed:
            try:
                target = resolve_version(plan.config.models[name])
            except RepositoryError as exc:
                log.error("SIGHUP: models.%s.version: %s", name, exc)
                continue
            if target != self.live[name]:
                self.reload.start(name, target, False, LoggedReply(f"reload of {name} to {target} (SIGHUP)"))
        for worker in self.workers.workers:
            self.reload.catch_up(worker)
        self._update_refusal()
        log.info("SIGHUP: applied %s", "; ".join(plan.applied) or "nothing (no live change)")
        if plan.need_restart:
            log.warning("SIGHUP: these changes need a restart and were not applied: %s",
                        "; ".join(plan.need_restart))

    def _keep_slots_large_enough(self, plan: reconfigure.Plan) -> reconfigure.Plan:
        """Refuse a larger max_batch_size whose full batch would not fit an arena slot."""
        for name, model in list(plan.config.models.items()):
            old = self.config.models.get(name)
            if old is None or model.max_batch_size <= old.max_batch_size:
                continue
            trial = msgspec.structs.replace(plan.config, models={**plan.config.models, name: model})
            for worker in self.workers.workers:
                loaded = worker.loaded.get((name, self.live[name]))
                if loaded and slot_bytes_needed(trial, name, loaded.outputs) > worker.slots.slot_size:
                    plan.config.models[name] = msgspec.structs.replace(model, max_batch_size=old.max_batch_size)
                    plan.need_restart.append(f"models.{name}.max_batch_size {model.max_batch_size}: a full "
                                             "batch would not fit an arena slot; raise workers.shm_mb too")
                    break
        return plan

    def _configure(self, config: Config) -> None:
        """Hand a new config to every part that reads one."""
        self.config = config
        self._spin_s = config.server.spin_us / 1e6
        self.queue.configure(config.queue.max_size, config.queue.max_per_client, _policies(config))
        self.frontend.configure(config)
        self.dispatcher.config = config
        self.workers.config = config
        self.reload.config = config
        set_level(config.server.log_level)
        for worker in self.workers.workers:
            self.workers.send_control(worker, messages.SetLogLevel(config.server.log_level))

    # -- cleanup ----------------------------------------------------------------

    def _cleanup(self) -> None:
        """Release everything this process made, whatever state it got to."""
        if self.metrics is not None:
            self.metrics.close()
        if self.reload is not None:
            self.reload.close()
        if self.workers is not None:
            for worker in self.workers.workers:
                if worker.process is not None and worker.process.exitcode is None:
                    self.workers.stop(worker)
            self.workers.wait_all(STOP_TIMEOUT_S)
        if self.frontend is not None:
            # Replies still queued in ZeroMQ get a moment to leave, unless some still
            # point into an arena that is about to close.
            clean = self.dispatcher is not None and not self.dispatcher.sending
            self.frontend.close(linger_ms=REPLY_FLUSH_MS if clean else 0)
        if self.control is not None:
            self.control.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.backend is not None:
            self.backend.close(linger=0)
            self.backend_path.unlink(missing_ok=True)
        for arena in self.arenas:
            arena.close()
            arena.unlink()
        if self.workers is not None:
            for worker in self.workers.workers:
                worker.stacks_path.unlink(missing_ok=True)
        self.probes.close()
        self.context.term()
        signal.set_wakeup_fd(-1)
        self._wakeup_r.close()
        self._wakeup_w.close()
        log.info("stopped")
