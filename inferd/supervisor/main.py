"""The supervisor: one loop that owns every socket, the queue, the arenas and the workers.

    clients ──▶ Frontend (ROUTER) ──▶ RequestQueue ──▶ Batcher ──▶ Dispatcher ──▶ arena slot + RunBatch ──▶ worker
    clients ◀── Replies ◀─────────── Dispatcher.on_result ◀───────────────────── BatchDone ◀──────────── worker

parts.py builds the parts; this module is the loop, the signals and the life cycle. Each decision lives in
the part that owns it: admission in the frontend, batching in the batcher, routing in the dispatcher, replies
in replies.py, versions in the reload manager, where on-demand models live in placement, processes in the
worker table, progress in liveness, SIGHUP in reconfigure. Signal handlers only queue the signal; the loop
wakes on a self-pipe and calls `handle_<signal>`. It blocks on one poller whose timeout is the nearest
batching, deadline or liveness event, or the housekeeping tick: an idle daemon sleeps.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from typing import Any

import setproctitle
import zmq

from inferd import __version__, protocol
from inferd.config.schema import Config
from inferd.ipc.arena import sweep_stale
from inferd.supervisor.control.report import systemd_status
from inferd.supervisor.control.trim_requests import TRIM_ANNOTATION
from inferd.supervisor.parts import Parts
from inferd.supervisor.processes.children import ChildProcess
from inferd.supervisor.processes.gateway_processes import Gateway
from inferd.supervisor.processes.workers import WorkerHandle, WorkerState
from inferd.supervisor.queueing.batcher import Capacity
from inferd.supervisor.shared.backstop import failure
from inferd.supervisor.shared.state import DaemonState, StartupError
from inferd.supervisor.wakeup import SIGNALS
from inferd.supervisor.worker_messages import WorkerMessages
from inferd.system import heap
from inferd.system.paths import runtime_dir
from inferd.system.shm_names import SHM_DIR

log = logging.getLogger("inferd.supervisor")

TICK_S = 0.5
SENDING_CHECK_S = 0.001  # how often slots held by replies still being sent are checked
SIGNAL_NAMES = {int(s): s.name[3:].lower() for s in SIGNALS}
NO_ROOM = Capacity(idle=False, spare=False, free_at=math.inf)


class Supervisor(Parts):
    """The daemon's main process: its parts (parts.py), and the loop that drives them."""

    def __init__(self, config: Config) -> None:
        """Build every part (nothing is bound or started yet); StartupError when a model has no version."""
        super().__init__(config)
        self.poller = zmq.Poller()
        self.exit_code = 0
        self.worker_messages = WorkerMessages(self.workers, self.dispatcher, self.reloads, self._maybe_started)
        self._children: dict[int, ChildProcess] = {}  # a process sentinel -> the worker or gateway it watches
        self._deadline = 0.0
        self._reconfigure_when_serving = False  # a SIGHUP came while the daemon started
        self._next_tick = 0.0
        self._next_liveness = 0.0
        self._done = False
        self._spin_s = config.server.spin_us / 1e6
        self._active = False  # the last poll found work: spin before the next blocks

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
            self.close()
            log.info("stopped")
        return self.exit_code

    def _start(self) -> None:
        setproctitle.setproctitle("inferd: supervisor")
        for folder in (SHM_DIR, runtime_dir()):
            for name in sweep_stale(folder) if folder.is_dir() else []:
                log.info("removed %s, left by a supervisor that is gone", name)
        self.handshakes.start()  # before any socket that asks it binds
        try:
            # The control socket first: it refuses to start beside a daemon that answers on it, before
            # anything named after it (the backend socket) is touched.
            self.control.bind()
            self.workers.open(self.instance)
            for front in {front.protocol: front for front in self.gateways}.values():
                front.check()
            self.frontend.bind({front.protocol: front.upstream for front in self.gateways})
            self.frontend.connections.count_own(time.monotonic())  # clients may connect from now on
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind: {exc.strerror}") from None
        self.files.pid.write_text(f"{os.getpid()}\n")
        self.metrics.start(self.config.server.metrics)
        self.wakeup.install()
        monitors = self.frontend.connections.monitors
        for sock in [*self.frontend.sockets, *monitors, self.control.socket, self.workers.backend,
                     self.handshakes.socket]:
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.wakeup.fileno(), zmq.POLLIN)
        # What exists now lives as long as the daemon; keep it out of every later collection.
        gc.freeze()
        now = time.monotonic()
        for worker in self.workers.workers:
            self.workers.spawn(worker, now)
            if worker.process is not None:
                self._watch(worker)
        for front in self.gateways:
            front.start()
            self._watch(front)
        log.info("inferd %s starting: pid %d, models %s", __version__, os.getpid(),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))

    def _loop(self) -> None:
        while not self._done:
            now = time.monotonic()
            queue_wakeup = self.batcher.next_wakeup(now)
            wait = min(TICK_S if queue_wakeup is None else queue_wakeup, max(0.0, self._next_tick - now),
                       self.systemd.watchdog.wait(now) or TICK_S, max(0.0, self._next_liveness - now),
                       max(0.0, self.dispatcher.next_deadline() - now), max(0.0, self.pipelines.next_deadline() - now))
            if self.dispatcher.sending:
                wait = min(wait, SENDING_CHECK_S)
            # Requests waiting mean every executor they could use is busy, and executors that will be busy for
            # longer than a spin have nothing to take: the loop will be woken by an answer, and the cores are
            # better left to the executors (and the clients) than spun on.
            spin = self._active and not len(self.queue) and self.dispatcher.free_within(now, self._spin_s)
            events = self._poll(wait, spin)
            self._active = bool(events)
            # Signals first: a request that arrives with a SIGTERM is already refused.
            readmit = False
            for target, _ in sorted(events, key=lambda event: event[0] != self.wakeup.fileno()):
                try:
                    readmit |= self._on_readable(target)
                except StartupError:
                    raise
                except Exception:  # noqa: BLE001 - the last guard: the loop serves on
                    failure("a socket event")
            if readmit:
                self.frontend.admit(self.state, self.workers, self.placement.refusals(time.monotonic()))
            self.frontend.note_queue_depths()
            now = time.monotonic()
            for request in self.queue.expire(now):
                self.replies.timed_out(request)
            self.dispatcher.expire_running(now)
            if self.dispatcher.sending:
                self.dispatcher.release_sent()
            self.pipelines.retry(now)
            self._dispatch()
            if now >= self._next_liveness:
                # Not on every turn: what it looks for is due at a time it knows, or by the tick.
                self.liveness.check(now)
                self._next_liveness = now + min(TICK_S, self.liveness.next_check_in(now))
            if now >= self._next_tick:
                self._next_tick = now + TICK_S
                self._housekeeping(now)
            hung = self.liveness.hung(now)
            self.systemd.report(now, hung[1] if hung else None, lambda: systemd_status(self))

    def _poll(self, wait: float, spin: bool) -> list[tuple[Any, int]]:
        """The sockets and fds that are ready, waiting at most `wait` seconds. With `spin` (the last poll found
        work) it polls without sleeping for server.spin_us first, yielding the core each turn: a core that went
        idle (a virtual CPU above all) takes far longer to wake than the next request takes to come."""
        events = self.poller.poll(0)
        if not events and spin and self._spin_s:
            spin_until = time.monotonic() + self._spin_s
            while not events and time.monotonic() < spin_until:
                os.sched_yield()
                events = self.poller.poll(0)
        return events or self.poller.poll(int(wait * 1000) + (wait > 0))

    def _on_readable(self, target: Any) -> bool:
        """Handle one ready socket or fd; True when what it brought may change what is admitted (a worker
        or gateway came or went, a version loaded, a signal): the loop then asks the frontend once."""
        if target is self.workers.backend:
            return self.worker_messages.on_readable()
        if target is self.control.socket:
            self.control.on_readable()
            self._maybe_started()  # a command may be a gateway saying it listens
        elif target == self.wakeup.fileno():
            self._on_wakeup()
        elif target in self._children:
            self._on_child_exit(target)
        elif target in self.frontend.connections.monitors:
            self.frontend.connections.on_monitor(target)
            return False
        elif target is self.handshakes.socket:
            self.handshakes.on_readable()
            return False
        else:
            self.frontend.on_readable(target)
            return False
        return True

    def _dispatch(self) -> None:
        now = time.monotonic()
        blocked: set[str] = set()  # models whose requests wait for an executor of their version

        def capacity(model: str) -> Capacity:
            return NO_ROOM if model in blocked else self.dispatcher.capacity(model)

        while (batch := self.batcher.take(capacity, now)) is not None:
            left = self.dispatcher.dispatch(*batch)
            if left:  # that executor's answer wakes the loop; the other models go on meanwhile
                self.queue.put_back(left)
                blocked.add(batch[0])
        self.placement.place_waiting(now)
        # Shadow work only on executor time no request wants.
        if self.dispatcher.shadow_jobs and not len(self.queue) and self.state == DaemonState.SERVING:
            self.dispatcher.run_shadow_jobs(now)

    def _housekeeping(self, now: float) -> None:
        if self.state in (DaemonState.STARTING, DaemonState.SERVING):
            self.workers.respawn_due(now)
            for front in self.gateways:
                if front.respawn_due(now):
                    front.start()
                    self._watch(front)
        for worker in self.workers.workers:
            if worker.process is not None and worker.process.sentinel not in self._children:
                self._watch(worker)
        if self.state == DaemonState.STARTING:
            self._check_started()
        elif self.state == DaemonState.DRAINING:
            if (len(self.queue) == 0 and not self.dispatcher.inflight and not self.dispatcher.sending
                    and not self.pipelines.blocked):
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
        self.frontend.admit(self.state, self.workers, self.placement.refusals(now))
        self.frontend.connections.check(now)
        heap.give_back()  # what requests' buffers took, once they are gone

    def _check_stopped(self) -> None:
        if (self.state == DaemonState.STOPPING and all(w.process is None for w in self.workers.workers)
                and all(front.process is None for front in self.gateways)):
            self._done = True

    def _maybe_started(self) -> None:
        if self.state == DaemonState.STARTING:
            self._check_started()

    def _check_started(self) -> None:
        workers = self.workers.workers
        if any(w.state not in (WorkerState.READY, WorkerState.FAILED) for w in workers) or \
                not all(front.up() for front in self.gateways):
            return
        errors = '; '.join(sorted({w.last_error for w in workers if w.last_error})) or 'see the log above'
        if all(w.state == WorkerState.FAILED for w in workers):
            raise StartupError(f"no worker could start: {errors}")
        # A worker with nothing to serve is ready too (the one that would hold tensor models, where every model
        # is a Python model's processes): a daemon none of whose models loaded serves nothing.
        loaded_at_start = [name for name in self.live if not self.config.models[name].on_demand]
        if loaded_at_start and not any(w.serves(name, self.live[name]) for name in loaded_at_start for w in workers):
            raise StartupError(f"no model could start: {errors}")
        self.state = DaemonState.SERVING
        self.systemd.serving()
        self.frontend.connections.count_own(time.monotonic())  # its workers and gateways connected now
        log.info("open files: %s", self.frontend.connections.budget.describe())
        failed = [w.name for w in workers if w.state == WorkerState.FAILED]
        if failed:
            log.warning("serving without %s, which failed to start", ", ".join(failed))
        log.info("ready: %d worker(s) serving %s", len(workers) - len(failed),
                 ", ".join(f"{n} {v}" for n, v in self.live.items()))
        if self._reconfigure_when_serving:
            self._reconfigure_when_serving = False
            self.handle_hup()

    # -- child processes ----------------------------------------------------------

    def _watch(self, child: ChildProcess) -> None:
        """Wake the loop when `child`'s process (a worker or a gateway, started) exits."""
        assert child.process is not None
        self._children[child.process.sentinel] = child
        self.poller.register(child.process.sentinel, zmq.POLLIN)

    def _on_child_exit(self, sentinel: int) -> None:
        self.poller.unregister(sentinel)
        child = self._children.pop(sentinel)
        now = time.monotonic()
        if isinstance(child, Gateway):
            child.reaped(now, self.config.workers.max_restarts)
        elif isinstance(child, WorkerHandle):
            reason = self.workers.reap(child, now, retry=self.state == DaemonState.SERVING)
            lost = self.dispatcher.fail_worker(child, f"{child.name} died ({reason}) while running the batch",
                                               retry=self.state == DaemonState.SERVING)
            self.queue.put_back(lost)  # computed again as soon as an executor is free
            if self.state == DaemonState.SERVING and all(w.state == WorkerState.FAILED for w in self.workers.workers):
                for request in self.queue.drain():  # no worker can come back to compute them
                    self.replies.error(request, protocol.UNAVAILABLE, "every worker was given up; nothing can "
                                       "compute the request (see inferctl status)")
            self.reloads.on_worker_exit(child)
            self.placement.on_worker_exit(child)
            self._maybe_started()
        self._check_stopped()

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
        self.pipelines.stop("the daemon stopped before the step ran")
        self._stop_workers()

    # -- signals ----------------------------------------------------------------

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
            self.systemd.stopping()
            self._deadline = now + self.config.server.drain_timeout_s
            self._next_tick = now
        elif self.state == DaemonState.DRAINING:
            log.warning("second stop signal: answering what is left `unavailable`")
            self._force_stop()

    handle_int = handle_term

    def handle_hup(self) -> None:
        """SIGHUP: re-read the config; apply what can change live, name what needs a restart. While the daemon
        starts, once it serves (systemd hears READY=1 only then); while it stops, not at all."""
        if self.state == DaemonState.STARTING:
            log.info("SIGHUP while starting: the config is read again once the daemon serves")
            self._reconfigure_when_serving = True
            return
        if self.state != DaemonState.SERVING:
            log.info("SIGHUP while stopping: ignored")
            return
        self.systemd.changing()
        try:
            self.reconfigurer.reconfigure(self.config)
        finally:
            self.systemd.changed()

    def handle_usr1(self) -> None:
        """SIGUSR1: faulthandler has written every thread's stack to the stacks file; log them too."""
        log.warning("SIGUSR1: thread stacks (also in %s):\n%s", self.files.stacks, self.wakeup.new_stacks().rstrip())

    def configure(self, config: Config) -> None:
        """Hand a new config to every part that reads one, and to the loop."""
        super().configure(config)
        self._spin_s = config.server.spin_us / 1e6
