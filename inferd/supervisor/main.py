"""The supervisor: one loop that owns every socket, the queue, the arenas and the workers.

    clients ──▶ Frontend (ROUTER) ──▶ RequestQueue ──▶ Batcher ──▶ Dispatcher ──▶ arena slot + RunBatch ──▶ worker
    clients ◀── Replies ◀─────────── Dispatcher.on_result ◀───────────────────── BatchDone ◀──────────── worker

This module is the loop, the signals, the life cycle and the clean-up; each
decision lives in the part that owns it: admission in the frontend, batching
in the batcher, placement in the dispatcher, versions in the reload manager,
processes in the worker table, progress in liveness, SIGHUP in reconfigure.
Signal handlers only queue the signal; the loop wakes on a self-pipe and calls
`handle_<signal>`. The loop blocks on one poller whose timeout is the nearest
batching, deadline or liveness event, or the housekeeping tick: an idle daemon
sleeps.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import setproctitle
import zmq

from inferd import __version__, protocol
from inferd.config.schema import Config
from inferd.curve import CurveServer
from inferd.ipc import messages
from inferd.ipc.arena import arena_name, new_instance, sweep_stale
from inferd.ipc.sockets import recv_parts
from inferd.logs import set_level
from inferd.oip.spec import PROTOCOLS
from inferd.paths import RuntimeFiles, runtime_dir
from inferd.repository import RepositoryError, SavedVersions
from inferd.shm_names import SHM_DIR
from inferd.supervisor.backstop import failure
from inferd.supervisor.batcher import Batcher, Capacity, queue_settings
from inferd.supervisor.canary import CanaryManager
from inferd.supervisor.candidates import Candidates
from inferd.supervisor.children import STOP_TIMEOUT_S
from inferd.supervisor.commands import Commands
from inferd.supervisor.control_server import ControlServer
from inferd.supervisor.devices import resolve_devices
from inferd.supervisor.dispatch import Dispatcher
from inferd.supervisor.forecast import ComputeTimes, Forecast
from inferd.supervisor.frontend import Frontend
from inferd.supervisor.gateway_processes import Gateway, configured_gateways
from inferd.supervisor.live import LiveVersions
from inferd.supervisor.liveness import Liveness
from inferd.supervisor.metrics import MetricsServer
from inferd.supervisor.probes import Probes
from inferd.supervisor.queue import RequestQueue
from inferd.supervisor.reaper import Reaper
from inferd.supervisor.reconfigure import Reconfigurer
from inferd.supervisor.regions import Regions
from inferd.supervisor.reload import ReloadManager
from inferd.supervisor.replies import Replies
from inferd.supervisor.state import DaemonState, StartupError
from inferd.supervisor.stats import Stats
from inferd.supervisor.trim_requests import TRIM_ANNOTATION, TrimRequests
from inferd.supervisor.wakeup import Wakeup
from inferd.supervisor.workers import WorkerHandle, WorkerState, WorkerTable
from inferd.systemd import StatusReport, notify

log = logging.getLogger("inferd.supervisor")

TICK_S = 0.5
REPLY_FLUSH_MS = 1000  # at exit, how long replies still queued to clients may take to leave
SENDING_CHECK_S = 0.001  # how often slots held by replies still being sent are checked
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
SIGNAL_NAMES = {int(s): s.name[3:].lower() for s in SIGNALS}
NO_ROOM = Capacity(idle=False, spare=False, free_at=math.inf)


class Supervisor:
    """The daemon's main process."""

    def __init__(self, config: Config) -> None:
        """Build every part (nothing is bound or started yet); StartupError when a model has no version."""
        self.config = config
        self.state = DaemonState.STARTING
        self.started = time.monotonic()
        saved = SavedVersions(config.server.state_dir or "")
        saved_live, previous, saved_candidates = saved.load()
        try:
            self.live = LiveVersions.first(config, saved_live, previous)
        except RepositoryError as exc:
            raise StartupError(f"cannot resolve model versions: {exc}") from None
        devices = resolve_devices(config.workers.devices)
        self.instance = new_instance()
        self.files = RuntimeFiles(config.server.control or "", self.instance)
        self.reaper = Reaper()
        # First, while this process has no thread and no socket: whatever kills it, this cleans up.
        self.reaper.start(
            arenas=[SHM_DIR / arena_name(self.instance, i) for i in range(len(devices))],
            sockets=[path for path in (self.files.control_socket, self.files.backend,
                                       *(self.files.upstream(name) for name in PROTOCOLS)) if path is not None],
            pid_file=self.files.pid,
            files=[self.files.stacks, *(self.files.worker_stacks(i) for i in range(len(devices)))],
        )
        self.context = zmq.Context()
        if hasattr(os, "SCHED_BATCH"):
            # ZeroMQ's I/O thread, woken by a reply, then does not preempt the loop that sent it:
            # it runs when the loop next waits, or on an idle core, and writes a whole batch of
            # replies in one go instead of costing a context switch each.
            self.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        self.poller = zmq.Poller()
        self.stats = Stats(self.started)
        self.probes = Probes()
        times = ComputeTimes()
        bounds, policies, levels = queue_settings(config)
        self.queue = RequestQueue(bounds, policies, levels)
        self.batcher = Batcher(self.queue, policies, times)
        self.curve = CurveServer(self.context, config.server.curve_secret_key, config.server.curve_authorized_keys)
        self.regions = Regions(config.server.client_shm_prefix)
        self.workers = WorkerTable(config, self.context, devices, self.files, self.live)
        self.forecast = Forecast(times, self.queue, self.workers, self.live)
        self.candidates = Candidates()
        self.replies = Replies(self.stats, self.live)
        self.dispatcher = Dispatcher(config, self.workers, self.replies, self.live, self.candidates, self.stats, times)
        self.frontend = Frontend(self.context, config, self.queue, self.replies, self.stats, self.live,
                                 self.candidates, self.curve, self.regions, self.forecast,
                                 self.dispatcher.cancel_running)
        self.reloads = ReloadManager(config, self.workers, self.dispatcher, self.live, self.candidates, saved,
                                     self.call_soon_threadsafe)
        self.canaries = CanaryManager(config, self.candidates, self.live, self.reloads, self.dispatcher, self.workers,
                                      self.stats)
        self.canaries.restore(saved_candidates)
        self.liveness = Liveness(self.workers, self.dispatcher, self.reloads)
        self.trim_requests = TrimRequests()
        self.trim_requests.configure(config.workers.trim_request_file)
        self.reconfigurer = Reconfigurer(self.workers, self.reloads, self.live, saved_live, self._configure)
        self.control = ControlServer(self.context, config.server.control or "", Commands(self), self.frontend,
                                     self.curve)
        self.metrics = MetricsServer(self)
        self.gateways = configured_gateways(config, devices, config.server.control or "",
                                             lambda name: f"ipc://{self.files.upstream(name)}")
        self._gateway_sentinels: dict[int, Gateway] = {}
        self.wakeup = Wakeup(self.files.stacks)
        self.systemd = StatusReport()
        self.exit_code = 0
        self._sentinels: dict[int, WorkerHandle] = {}
        self._deadline = 0.0
        self._next_tick = 0.0
        self._next_liveness = 0.0
        self._done = False
        self._spin_s = config.server.spin_us / 1e6
        self._active = False  # the last poll found work: spin before the next blocks

    @property
    def listening(self) -> list[str]:
        """The data endpoints as bound (a port 0 is the one the system picked)."""
        return self.frontend.listening

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
        setproctitle.setproctitle("inferd: supervisor")
        for folder in (SHM_DIR, runtime_dir()):
            for name in sweep_stale(folder) if folder.is_dir() else []:
                log.info("removed %s, left by a supervisor that is gone", name)
        self.curve.start()
        try:
            # The control socket first: it refuses to start beside a daemon that answers on it, before
            # anything named after it (the backend socket) is touched.
            self.control.bind()
            self.workers.open(self.instance)
            for front in self.gateways:
                front.check()
            self.frontend.bind({front.protocol: front.upstream for front in self.gateways})
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind: {exc.strerror}") from None
        self.files.pid.write_text(f"{os.getpid()}\n")
        self.metrics.start(self.config.server.metrics)
        self.wakeup.install(SIGNALS)
        monitors = self.frontend.client_regions.monitors
        for sock in [*self.frontend.sockets, *monitors, self.control.socket, self.workers.backend]:
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.wakeup.fileno(), zmq.POLLIN)
        # What exists now lives as long as the daemon; keep it out of every later collection.
        gc.freeze()
        now = time.monotonic()
        for worker in self.workers.workers:
            self.workers.spawn(worker, now)
            self._watch(worker)
        for front in self.gateways:
            self._start_gateway(front)
        log.info("inferd %s starting: pid %d, models %s", __version__, os.getpid(),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))

    def _loop(self) -> None:
        while not self._done:
            now = time.monotonic()
            queue_wakeup = self.batcher.next_wakeup(now)
            wait = min(TICK_S if queue_wakeup is None else queue_wakeup, max(0.0, self._next_tick - now),
                       self.systemd.watchdog.wait(now) or TICK_S, max(0.0, self._next_liveness - now))
            if self.dispatcher.sending:
                wait = min(wait, SENDING_CHECK_S)
            # Requests waiting mean every executor they could use is busy: the loop will be woken
            # by an answer, and the cores are better left to the executors than spun on.
            events = self._poll(wait, spin=self._active and not len(self.queue))
            self._active = bool(events)
            # Signals first: a request that arrives with a SIGTERM is already refused.
            for target, _ in sorted(events, key=lambda event: event[0] != self.wakeup.fileno()):
                try:
                    self._on_readable(target)
                except StartupError:
                    raise
                except Exception:  # noqa: BLE001 - the last guard: the loop serves on
                    failure("a socket event")
            self.frontend.note_queue_depths()
            now = time.monotonic()
            for request in self.queue.expire(now):
                self.replies.timed_out(request)
            if self.dispatcher.sending:
                self.dispatcher.release_sent()
            self._dispatch()
            if now >= self._next_liveness:
                # Not on every turn: what it looks for is due at a time it knows, or by the tick.
                self.liveness.check(now)
                self._next_liveness = now + min(TICK_S, self.liveness.next_check_in(now))
            if now >= self._next_tick:
                self._next_tick = now + TICK_S
                self._housekeeping(now)
            hung = self.liveness.hung(now)
            self.systemd.report(now, hung[1] if hung else None, self._status)

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
        if target is self.workers.backend:
            self._on_backend()
        elif target is self.control.socket:
            self.control.on_readable()
        elif target == self.wakeup.fileno():
            self._on_wakeup()
        elif target in self._sentinels:
            self._on_worker_exit(self._sentinels[target])
        elif target in self.frontend.client_regions.monitors:
            self.frontend.client_regions.on_monitor(target)
        elif target in self._gateway_sentinels:
            self.poller.unregister(target)
            self._gateway_sentinels.pop(target).reaped(time.monotonic(), self.config.workers.max_restarts)
            self._check_stopped()
        else:
            self.frontend.on_readable(target)

    def _dispatch(self) -> None:
        now = time.monotonic()
        blocked: set[str] = set()  # models whose requests wait for an executor of their version

        def capacity(model: str) -> Capacity:
            return NO_ROOM if model in blocked else self.dispatcher.capacity(model)

        while True:
            batch = self.batcher.take(capacity, now)
            if batch is None:
                break
            left = self.dispatcher.dispatch(*batch)
            if left:  # that executor's answer wakes the loop; the other models go on meanwhile
                self.queue.put_back(left)
                blocked.add(batch[0])
        # Shadow work only on executor time no request wants.
        if self.dispatcher.shadow_jobs and not len(self.queue) and self.state == DaemonState.SERVING:
            self.dispatcher.run_shadow_jobs(now)

    def _housekeeping(self, now: float) -> None:
        if self.state in (DaemonState.STARTING, DaemonState.SERVING):
            self.workers.respawn_due(now)
            for front in self.gateways:
                if front.respawn_due(now):
                    self._start_gateway(front)
        for worker in self.workers.workers:
            if worker.process is not None and worker.process.sentinel not in self._sentinels:
                self._watch(worker)
        if self.state == DaemonState.STARTING:
            self._check_started()
        elif self.state == DaemonState.DRAINING:
            if len(self.queue) == 0 and not self.dispatcher.inflight and not self.dispatcher.sending:
                self._stop_workers()
            elif now >= self._deadline:
                log.warning("drain timeout passed; stopping with work left")
                self._force_stop()
        elif self.state == DaemonState.SERVING and self.candidates:
            try:
                self.canaries.check(now)
            except Exception:  # noqa: BLE001 - the last guard: trials are judged again next tick
                failure("the canary guard")
        if self.state == DaemonState.SERVING and (request := self.trim_requests.due()) is not None:
            self.workers.trim_memory(f"the pod annotation {TRIM_ANNOTATION}={request}")
        self._check_stopped()
        self.frontend.admit(self.state, self.workers)

    def _check_stopped(self) -> None:
        if (self.state == DaemonState.STOPPING and all(w.process is None for w in self.workers.workers)
                and all(front.process is None for front in self.gateways)):
            self._done = True

    def _start_gateway(self, front: Gateway) -> None:
        front.start()
        assert front.process is not None
        self._gateway_sentinels[front.process.sentinel] = front
        self.poller.register(front.process.sentinel, zmq.POLLIN)

    def _check_started(self) -> None:
        workers = self.workers.workers
        if any(w.state not in (WorkerState.READY, WorkerState.FAILED) for w in workers):
            return
        if all(w.state == WorkerState.FAILED for w in workers):
            errors = {w.last_error for w in workers if w.last_error}
            raise StartupError(f"no worker could start: {'; '.join(sorted(errors)) or 'see the log above'}")
        self.state = DaemonState.SERVING
        notify("READY=1")
        failed = [w.index for w in workers if w.state == WorkerState.FAILED]
        if failed:
            log.warning("serving without worker(s) %s, which failed to start", failed)
        log.info("ready: %d worker(s) serving %s", len(workers) - len(failed),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))

    def _status(self) -> tuple[str, int]:
        """The one-line summary systemd shows, and the replies so far (for the rate)."""
        ready = sum(w.state == WorkerState.READY for w in self.workers.workers)
        live = ", ".join(f"{n} {v}" + (f" ({self.candidates[n].describe()})" if n in self.candidates else "")
                         for n, v in self.live.items())
        summary = f"{self.state}; {ready}/{len(self.workers.workers)} workers ready; {live}"
        return summary, sum(self.stats.replies.values())

    # -- workers ----------------------------------------------------------------

    def _watch(self, worker: WorkerHandle) -> None:
        assert worker.process is not None
        sentinel = worker.process.sentinel
        self._sentinels[sentinel] = worker
        self.poller.register(sentinel, zmq.POLLIN)

    def _on_worker_exit(self, worker: WorkerHandle) -> None:
        assert worker.process is not None
        sentinel = worker.process.sentinel
        self.poller.unregister(sentinel)
        del self._sentinels[sentinel]
        reason = self.workers.reap(worker, time.monotonic(), retry=self.state == DaemonState.SERVING)
        self.dispatcher.fail_worker(worker, f"worker{worker.index} died ({reason}) while running the batch")
        self.reloads.on_worker_exit(worker)
        if self.state == DaemonState.STARTING:
            self._check_started()
        self._check_stopped()
        self.frontend.admit(self.state, self.workers)

    def _on_backend(self) -> None:
        while (parts := recv_parts(self.workers.backend)) is not None:
            try:
                self._on_worker_message(parts)
            except StartupError:
                raise
            except Exception:  # noqa: BLE001 - the last guard: a message no reply can go to is dropped
                failure("a message from a worker")

    def _on_worker_message(self, parts: list[zmq.Frame]) -> None:
        if len(parts) != 2:
            return
        identity, payload = parts[0].bytes, parts[1].buffer
        try:
            message = messages.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("malformed message from a worker socket ignored")
            return
        if isinstance(message, (messages.BatchDone, messages.BatchFailed)):
            executor = self.workers.executor_of(identity)
            if executor is not None:
                self.dispatcher.on_result(executor, message)
                if self.reloads.retiring:
                    self.reloads.retire_idle()
            return
        if isinstance(message, (messages.VersionLoaded, messages.VersionFailed)):
            sender = self.workers.worker_of(identity)
            if sender is not None:
                self.reloads.on_message(sender, message)
                self.frontend.admit(self.state, self.workers)
            return
        worker = self.workers.on_message(identity, message)
        if worker is not None:
            self.reloads.catch_up(worker)
            if self.state == DaemonState.STARTING:
                self._check_started()
            self.frontend.admit(self.state, self.workers)

    def _stop_workers(self) -> None:
        self.state = DaemonState.STOPPING
        for worker in self.workers.workers:
            self.workers.stop(worker)
        for front in self.gateways:
            front.stop()

    def _force_stop(self) -> None:
        for request in self.queue.drain():
            self.replies.error(request, protocol.UNAVAILABLE, "the daemon stopped before the request ran")
        for worker in self.workers.workers:
            self.dispatcher.fail_worker(worker, "the daemon stopped before the request finished", protocol.UNAVAILABLE)
        self._stop_workers()

    # -- signals ----------------------------------------------------------------

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread; any thread may call this."""
        self.wakeup.call_soon_threadsafe(callback)

    def _on_wakeup(self) -> None:
        signals, callbacks = self.wakeup.take()
        for signum in signals:
            getattr(self, f"handle_{SIGNAL_NAMES[signum]}")()
        for callback in callbacks:
            callback()

    def handle_term(self) -> None:
        """SIGTERM: stop taking requests, finish the queued ones, exit; a second one hurries."""
        now = time.monotonic()
        if self.state in (DaemonState.STARTING, DaemonState.SERVING):
            log.info("stopping: finishing %d queued and %d running batch(es), at most %g s",
                     len(self.queue), len(self.dispatcher.inflight), self.config.server.drain_timeout_s)
            self.state = DaemonState.DRAINING
            notify("STOPPING=1")
            self._deadline = now + self.config.server.drain_timeout_s
            self._next_tick = now
        elif self.state == DaemonState.DRAINING:
            log.warning("second stop signal: answering what is left `unavailable`")
            self._force_stop()
        self.frontend.admit(self.state, self.workers)

    handle_int = handle_term

    def handle_hup(self) -> None:
        """SIGHUP: re-read the config; apply what can change live, name what needs a restart."""
        notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            self.reconfigurer.reconfigure(self.config)
            self.frontend.admit(self.state, self.workers)
        finally:
            notify("READY=1")

    def handle_usr1(self) -> None:
        """SIGUSR1: faulthandler has written every thread's stack to the stacks file; log them too."""
        log.warning("SIGUSR1: thread stacks (also in %s):\n%s", self.files.stacks, self.wakeup.new_stacks().rstrip())

    def _configure(self, config: Config) -> None:
        """Hand a new config to every part that reads one."""
        self.config = config
        self._spin_s = config.server.spin_us / 1e6
        bounds, policies, levels = queue_settings(config)
        self.queue.configure(bounds, policies, levels)
        self.batcher.configure(policies)
        self.frontend.configure(config)
        self.dispatcher.configure(config)
        self.workers.configure(config)
        self.reloads.configure(config)
        self.canaries.configure(config)
        self.trim_requests.configure(config.workers.trim_request_file)
        set_level(config.server.log_level)
        for worker in self.workers.workers:
            self.workers.send_control(worker, messages.SetLogLevel(config.server.log_level))

    # -- cleanup ----------------------------------------------------------------

    def _cleanup(self) -> None:
        """Release everything this process made, whatever state it got to."""
        self.metrics.close()
        self.reloads.close()
        for worker in self.workers.workers:
            if worker.process is not None and worker.process.exitcode is None:
                self.workers.stop(worker)
        self.workers.wait_all(STOP_TIMEOUT_S)
        for front in self.gateways:
            front.wait()
        # Replies still queued in ZeroMQ get a moment to leave, unless some still
        # point into an arena that is about to close.
        self.frontend.close(linger_ms=0 if self.dispatcher.sending else REPLY_FLUSH_MS)
        self.control.close()
        self.curve.stop()
        self.workers.close()
        self.wakeup.close()
        if self.files.pid.exists() and self.files.pid.read_text().strip() == str(os.getpid()):
            self.files.pid.unlink()
        self.probes.close()
        self.context.term()
        self.reaper.release()
        log.info("stopped")
