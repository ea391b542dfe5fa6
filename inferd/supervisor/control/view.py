"""What the control commands, the stats report and the metrics read of the daemon.

A narrow view, not the Supervisor: they need the daemon's parts, never its
loop, and naming the parts here keeps them from importing supervisor/main.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from inferd.config.schema import Config
from inferd.models.repository import VersionNumbers
from inferd.supervisor.control.reconfigure import Reconfigurer
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.intake.connections import Connections
from inferd.supervisor.intake.forecast import Forecast
from inferd.supervisor.pipelines.runner import Pipelines
from inferd.supervisor.processes.gateway_processes import Gateway
from inferd.supervisor.processes.probes import Probes
from inferd.supervisor.processes.workers import WorkerTable
from inferd.supervisor.queueing.queue import RequestQueue
from inferd.supervisor.shared.candidates import Candidates
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.regions import Regions
from inferd.supervisor.shared.state import DaemonState
from inferd.supervisor.shared.stats import Stats
from inferd.supervisor.versions.canary import CanaryManager
from inferd.supervisor.versions.placement import Placement
from inferd.supervisor.versions.reload import ReloadManager


class DaemonView(Protocol):
    """The parts of a running daemon that commands, reports and metrics read."""

    @property
    def state(self) -> DaemonState:
        """Where the daemon is in its life."""

    @property
    def started(self) -> float:
        """When it started (time.monotonic())."""

    @property
    def config(self) -> Config:
        """The config it runs with now."""

    @property
    def listening(self) -> list[str]:
        """The data endpoints as bound: a tcp:// one configured with port 0 has the port the system picked."""

    @property
    def live(self) -> LiveVersions:
        """The live version of each model."""

    @property
    def version_numbers(self) -> VersionNumbers:
        """Each version's number, for the protocols whose versions are integers."""

    @property
    def queue(self) -> RequestQueue:
        """The requests waiting."""

    @property
    def stats(self) -> Stats:
        """Every measurement of requests and batches."""

    @property
    def workers(self) -> WorkerTable:
        """The workers."""

    @property
    def gateways(self) -> list[Gateway]:
        """The Open Inference Protocol's gateway processes."""

    @property
    def connections(self) -> Connections:
        """The client connections the frontend's sockets have."""

    @property
    def regions(self) -> Regions:
        """Clients' registered shared-memory regions."""

    @property
    def reloads(self) -> ReloadManager:
        """Reloads running, and the way to start one."""

    @property
    def placement(self) -> Placement:
        """Where on-demand models are loaded, and the way to load or unload one."""

    @property
    def reconfigurer(self) -> Reconfigurer:
        """The way to read the config again (a SIGHUP)."""

    @property
    def candidates(self) -> Candidates:
        """The version of each model under trial, if any."""

    @property
    def canaries(self) -> CanaryManager:
        """Trials: the way to start, weigh, promote and end one, and the guard's judgement."""

    @property
    def dispatcher(self) -> Dispatcher:
        """Batches in flight, and how each model's batches split between its versions."""

    @property
    def forecast(self) -> Forecast:
        """Compute times, and when a new request would finish."""

    @property
    def pipelines(self) -> Pipelines:
        """The pipelines, and their requests under way."""

    @property
    def probes(self) -> Probes:
        """What psutil and NVML say of the workers."""

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread; any thread may call this."""
