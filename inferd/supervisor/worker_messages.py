"""The workers' messages on the backend socket, each handed to the part that owns what it says.

A batch's result goes to the dispatcher, a version loaded or refused to the
reload manager, a worker's hello, readiness or error to the worker table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq

from inferd.ipc import messages
from inferd.ipc.sockets import recv_parts
from inferd.supervisor.dispatch.dispatcher import Dispatcher
from inferd.supervisor.processes.workers import WorkerTable
from inferd.supervisor.shared.backstop import failure
from inferd.supervisor.shared.state import StartupError
from inferd.supervisor.versions.reload import ReloadManager

log = logging.getLogger("inferd.supervisor")


class WorkerMessages:
    """Reads the backend socket and routes what each worker says."""

    def __init__(self, workers: WorkerTable, dispatcher: Dispatcher, reloads: ReloadManager,
                 on_worker_changed: Callable[[], None]) -> None:
        self.workers = workers
        self.dispatcher = dispatcher
        self.reloads = reloads
        self._on_worker_changed = on_worker_changed  # a worker said something about itself (it is up, say)

    def on_readable(self) -> bool:
        """Route every message waiting; True when one was about a worker or a version rather than a batch,
        so what the daemon admits may have changed."""
        changed = False
        while (parts := recv_parts(self.workers.backend)) is not None:
            try:
                changed |= self._route(parts)
            except StartupError:
                raise
            except Exception:  # noqa: BLE001 - the last guard: a message no reply can go to is dropped
                failure("a message from a worker")
        return changed

    def _route(self, parts: list[zmq.Frame]) -> bool:
        if len(parts) != 2:
            return False
        identity, payload = parts[0].bytes, parts[1].buffer
        try:
            message = messages.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("malformed message from a worker socket ignored")
            return False
        if isinstance(message, (messages.BatchDone, messages.BatchFailed)):
            executor = self.workers.executor_of(identity)
            if executor is not None:
                self.dispatcher.on_result(executor, message)
                if self.reloads.retiring:
                    self.reloads.retire_idle()
            return False
        if isinstance(message, (messages.VersionLoaded, messages.VersionFailed)):
            sender = self.workers.worker_of(identity)
            if sender is not None:
                self.reloads.on_message(sender, message)
            return True
        worker = self.workers.on_message(identity, message)
        if worker is not None:
            self.reloads.catch_up(worker)
            self._on_worker_changed()
        return True
