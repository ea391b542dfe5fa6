"""The supervisor's parts, built and wired together: the composition root.

Each part gets, when it is built, the others it reads or hands work to; none
looks another up later. Nothing is bound or started here (the loop in main.py
does that), except the reaper, which starts first so that whatever kills the
process, what it makes is cleaned up. `configure` hands a SIGHUP's config to
every part that reads one; `close` releases everything, whatever state the
daemon got to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.ipc.arena import arena_names, new_instance
from inferd.ipc.curve import CurveServer
from inferd.models.repository import RepositoryError, SavedVersions, VersionNumbers, config_name
from inferd.oip.spec import PROTOCOLS
from inferd.supervisor.control.commands import Commands
from inferd.supervisor.control.control_server import ControlServer
from inferd.supervisor.control.metrics import MetricsServer
from inferd.supervisor.control.reconfigure import Reconfigurer
from inferd.supervisor.control.trim_requests import TrimRequests
from inferd.supervisor.dispatch.compute_times import ComputeTimes
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.dispatch.replies import Replies
from inferd.supervisor.intake import descriptors
from inferd.supervisor.intake.connections import Connections
from inferd.supervisor.intake.forecast import Forecast
from inferd.supervisor.intake.frontend import Frontend
from inferd.supervisor.intake.handshakes import Handshakes
from inferd.supervisor.liveness import Liveness
from inferd.supervisor.pipelines.runner import Pipelines
from inferd.supervisor.processes.children import STOP_TIMEOUT_S, fork_server_folder, start_fork_server
from inferd.supervisor.processes.devices import resolve_devices
from inferd.supervisor.processes.gateway_processes import configured_gateways
from inferd.supervisor.processes.probes import Probes
from inferd.supervisor.processes.reaper import Reaper
from inferd.supervisor.processes.workers import WorkerTable, step_pools
from inferd.supervisor.queueing.batcher import Batcher, queue_settings
from inferd.supervisor.queueing.queue import RequestQueue
from inferd.supervisor.shared.candidates import Candidates
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.regions import Regions
from inferd.supervisor.shared.state import DaemonState, StartupError
from inferd.supervisor.shared.stats import Stats
from inferd.supervisor.versions.canary import CanaryManager
from inferd.supervisor.versions.placement import Placement
from inferd.supervisor.versions.reload import ReloadManager
from inferd.supervisor.wakeup import Wakeup
from inferd.system.logs import set_level
from inferd.system.paths import RuntimeFiles
from inferd.system.shm_names import SHM_DIR
from inferd.system.systemd import Systemd

REPLY_FLUSH_MS = 1000  # at exit, how long replies still queued to clients may take to leave


class Parts:
    """Every part of the supervisor, and what the control commands and the metrics read of them."""

    def __init__(self, config: Config) -> None:
        """Build every part; StartupError when a model has no version to serve."""
        descriptors.raise_limit()  # before any child process starts: they inherit it
        self.config = config
        self.state = DaemonState.STARTING  # the loop's to change; read by commands and admission
        self.started = time.monotonic()
        owner = config_name(config.source)
        saved = SavedVersions(config.server.state_dir or "", owner)
        saved_live, previous, saved_candidates = saved.load()
        self.version_numbers = VersionNumbers(config.server.state_dir or "", owner)
        try:
            self.live = LiveVersions.first(config, saved_live, previous)
        except RepositoryError as exc:
            raise StartupError(f"cannot resolve model versions: {exc}") from None
        devices = resolve_devices(config.workers.devices)
        pools = step_pools(config, self.live)
        self.instance = new_instance()
        self.files = RuntimeFiles(config.server.control or "", self.instance)
        self.reaper = Reaper()
        # First, while this process has no thread and no socket: whatever kills it, this cleans up.
        self.reaper.start(
            arenas=[SHM_DIR / arena_names(self.instance)],
            sockets=[path for path in (self.files.control_socket, self.files.backend,
                                       *(self.files.upstream(name) for name in PROTOCOLS)) if path is not None],
            pid_file=self.files.pid,
            files=[self.files.stacks, *(self.files.worker_stacks(i) for i in range(len(devices)))],
            file_globs=[self.files.every_step_stacks],
            folders=[fork_server_folder()],
        )
        start_fork_server()
        self.context = zmq.Context()  # one I/O thread, which intake/handshakes.py relies on
        if hasattr(os, "SCHED_BATCH"):
            # ZeroMQ's I/O thread, woken by a reply, then does not preempt the loop that sent it:
            # it runs when the loop next waits, or on an idle core, and writes a whole batch of
            # replies in one go instead of costing a context switch each.
            self.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        self.wakeup = Wakeup(self.files.stacks)
        self.systemd = Systemd()
        self.stats = Stats(self.started)
        self.probes = Probes()
        times = ComputeTimes()
        bounds, policies, levels = queue_settings(config)
        self.queue = RequestQueue(bounds, policies, levels)
        self.batcher = Batcher(self.queue, policies, times)
        self.curve = CurveServer(config.server.curve_secret_key, config.server.curve_authorized_keys)
        self.regions = Regions(config.server.client_shm_prefix)
        self.workers = WorkerTable(config, self.context, devices, self.files, self.live, pools)
        self.forecast = Forecast(times, self.queue, self.workers, self.live)
        self.candidates = Candidates()
        self.replies = Replies(self.stats, self.live)
        self.dispatcher = Dispatcher(config, self.workers, self.replies, self.live, self.candidates, self.stats, times)
        self.pipelines = Pipelines(config, self.queue, self.replies, self.stats)
        self.frontend = Frontend(self.context, config, self.queue, self.replies, self.stats, self.live,
                                 self.candidates, self.curve, self.regions, self.forecast,
                                 self.dispatcher.cancel_running, self.workers.signature, self.pipelines)
        self.handshakes = Handshakes(self.context, self.curve, self.frontend.connections)
        self.reloads = ReloadManager(config, self.workers, self.dispatcher, self.live, self.candidates, saved,
                                     self.systemd, self.wakeup.call_soon_threadsafe)
        self.canaries = CanaryManager(config, self.candidates, self.live, self.reloads, self.dispatcher, self.workers,
                                      self.stats)
        self.canaries.restore(saved_candidates)
        self.placement = Placement(config, self.workers, self.reloads, self.dispatcher, self.queue, self.replies,
                                   self.live, self.stats)
        self.liveness = Liveness(self.workers, self.dispatcher, self.reloads)
        self.trim_requests = TrimRequests()
        self.trim_requests.configure(config.workers.trim_request_file)
        self.reconfigurer = Reconfigurer(self.workers, self.reloads, self.live, saved_live, self.configure,
                                         lambda: self.config)
        self.control = ControlServer(self.context, config.server.control or "", Commands(self), self.frontend,
                                     self.curve)
        self.metrics = MetricsServer(self)
        self.gateways = configured_gateways(config, devices, config.server.control or "",
                                             lambda name: f"ipc://{self.files.upstream(name)}")

    @property
    def connections(self) -> Connections:
        """The client connections the frontend's sockets have."""
        return self.frontend.connections

    @property
    def listening(self) -> list[str]:
        """The data endpoints as bound (a port 0 is the one the system picked)."""
        return self.frontend.listening

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread; any thread may call this."""
        self.wakeup.call_soon_threadsafe(callback)

    def configure(self, config: Config) -> None:
        """Hand a new config (a SIGHUP's) to every part that reads one."""
        self.config = config
        bounds, policies, levels = queue_settings(config)
        self.queue.configure(bounds, policies, levels)
        self.batcher.configure(policies)
        self.frontend.configure(config)
        self.pipelines.configure(config)
        self.dispatcher.configure(config)
        self.workers.configure(config)
        self.reloads.configure(config)
        self.canaries.configure(config)
        self.placement.configure(config)
        self.trim_requests.configure(config.workers.trim_request_file)
        set_level(config.server.log_level)
        for worker in self.workers.workers:
            self.workers.send_control(worker, messages.SetLogLevel(config.server.log_level))

    def close(self) -> None:
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
        self.handshakes.close()
        self.workers.close()
        self.wakeup.close()
        if self.files.pid.exists() and self.files.pid.read_text().strip() == str(os.getpid()):
            self.files.pid.unlink()
        self.probes.close()
        self.context.term()
        self.reaper.release()
