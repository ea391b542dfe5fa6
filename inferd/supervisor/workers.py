"""The worker table: spawn, hand-shake, reap and respawn worker processes.

Each worker is bound to one device and one arena for the daemon's lifetime;
its process may be replaced, and each replacement carries a new generation.
Messages from a generation that is gone are ignored, so a late message from a
dead process can never be taken for its successor's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import msgspec
import zmq

from inferd import config as config_module
from inferd.config import Config
from inferd.ipc import messages
from inferd.ipc.arena import Arena, SlotPool
from inferd.ipc.messages import LoadedModel
from inferd.ipc.sockets import send_parts
from inferd.worker.main import WorkerSpec, worker_main

log = logging.getLogger("inferd.workers")

BOOTING, READY, STOPPING, DEAD, FAILED = "booting", "ready", "stopping", "dead", "failed"
PIPELINE_DEPTH = 2  # batches an executor may hold: one running, one waiting behind it
CRASH_WINDOW_S = 60.0  # deaths counted against workers.max_restarts within this window
MAX_BACKOFF_S = 30.0
ABORT_GRACE_S = 2.0  # a hung worker gets SIGABRT, then SIGKILL this much later
STOP_TIMEOUT_S = 10.0

_spawn = multiprocessing.get_context("spawn")


@dataclass(eq=False)
class ExecutorHandle:
    """One executor of a worker, as the dispatcher sees it."""

    worker: WorkerHandle
    index: int
    identity: bytes | None = None
    inflight: int = 0
    last_used: float = 0.0  # when it was last sent a batch (monotonic)


@dataclass(eq=False)
class WorkerHandle:
    """One worker slot: a device, an arena, and the process currently serving them."""

    index: int
    device: str
    arena: Arena
    slots: SlotPool
    stacks_path: Path
    generation: int = 0
    state: str = DEAD
    process: BaseProcess | None = None
    control: bytes | None = None
    executors: list[ExecutorHandle] = field(default_factory=list)
    loaded: dict[tuple[str, str], LoadedModel] = field(default_factory=dict)  # (model, version) -> signature
    started: float = 0.0
    respawn_at: float = 0.0
    restarts: int = 0
    batches: int = 0
    last_error: str = ""
    give_up: bool = False
    stopping_since: float = 0.0
    deaths: deque = field(default_factory=deque)  # times of its recent unexpected exits
    hung: str | None = None  # why it is being aborted as hung
    hung_since: float = 0.0
    memory: int = 0  # after its last batch: device bytes allocated on a GPU, resident bytes on the CPU
    reserved: int = 0  # GPU allocator's reserved bytes
    memory_baseline: int | None = None  # `memory` after warm-up; None until a batch sets it
    leak_warned: bool = False

    @property
    def memory_growth(self) -> int:
        """Bytes the worker's memory grew over its level after warm-up."""
        return 0 if self.memory_baseline is None else max(0, self.memory - self.memory_baseline)

    @property
    def pid(self) -> int | None:
        """The pid of the current process, if one runs."""
        return self.process.pid if self.process is not None else None

    def serves(self, model: str, version: str) -> bool:
        """True when this worker is ready and has `version` of `model` loaded and warmed."""
        return self.state == READY and (model, version) in self.loaded


class WorkerTable:
    """Every worker of the daemon, and the backend socket they talk to it on."""

    def __init__(self, config: Config, backend: zmq.Socket, endpoint: str, arenas: list[Arena], devices: list[str],
                 runtime_dir: Path):
        self.config = config
        self.backend = backend
        self.endpoint = endpoint
        self.versions: dict[str, str] = {}
        slot_count = PIPELINE_DEPTH * config.workers.streams
        self.workers = [
            WorkerHandle(index=i, device=device, arena=arena, slots=SlotPool(arena.size, slot_count),
                         stacks_path=runtime_dir / f"{arena.name}.stacks")
            for i, (device, arena) in enumerate(zip(devices, arenas))
        ]
        self._roles: dict[bytes, tuple[WorkerHandle, int, ExecutorHandle | None]] = {}

    def spawn(self, worker: WorkerHandle, now: float) -> None:
        """Start a new process, of a new generation, for `worker`."""
        worker.generation += 1
        spec = WorkerSpec(
            worker=worker.index,
            generation=worker.generation,
            device=worker.device,
            backend=self.endpoint,
            arena=worker.arena.name,
            config=config_module.encode(self.config),
            versions=dict(self.versions),
            stacks=str(worker.stacks_path),
        )
        process = _spawn.Process(
            target=worker_main, args=(msgspec.msgpack.encode(spec),), name=f"inferd-worker{worker.index}"
        )
        process.start()
        worker.process = process
        worker.state = BOOTING
        worker.started = now
        worker.control = None
        worker.loaded = {}
        worker.memory_baseline = None
        worker.leak_warned = False
        worker.executors = [ExecutorHandle(worker, k) for k in range(self.config.workers.streams)]
        log.info("worker%d generation %d started on %s, pid %d", worker.index, worker.generation, worker.device, process.pid)

    def send(self, identity: bytes, message: messages.Message) -> bool:
        """Send to one worker socket; False when that socket is gone."""
        try:
            send_parts(self.backend, [identity, messages.encode(message)])
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot reach worker socket %r: %s", identity, exc.strerror)
            return False

    def worker_of(self, identity: bytes) -> WorkerHandle | None:
        """The worker behind a socket identity, if it belongs to a live generation."""
        role = self._live_role(identity)
        return None if role is None else role[0]

    def on_message(self, identity: bytes, message: messages.Message) -> WorkerHandle | None:
        """Handle a lifecycle message; return the worker that became ready, if any."""
        if isinstance(message, messages.Hello):
            self._on_hello(identity, message)
            return None
        worker = self.worker_of(identity)
        if worker is None:
            return None
        if isinstance(message, messages.Ready) and worker.state == BOOTING:
            worker.loaded = {(name, m.version): m for name, m in message.models.items()}
            worker.state = READY
            log.info("worker%d ready on %s (pid %d)", worker.index, worker.device, message.pid)
            return worker
        if isinstance(message, messages.BootFailed):
            worker.last_error = message.error
            log.error("worker%d failed to boot: %s", worker.index, message.error)
        return None

    def executor_of(self, identity: bytes) -> ExecutorHandle | None:
        """The executor behind a socket identity, if it belongs to a live generation."""
        role = self._live_role(identity)
        return None if role is None else role[2]

    def _live_role(self, identity: bytes) -> tuple[WorkerHandle, int, ExecutorHandle | None] | None:
        role = self._roles.get(identity)
        return None if role is None or role[0].generation != role[1] else role

    def note_memory(self, worker: WorkerHandle, memory: int, reserved: int) -> None:
        """The leak watch: a worker's memory after a batch, against its level after warm-up."""
        worker.memory, worker.reserved = memory, reserved
        if worker.memory_baseline is None:
            worker.memory_baseline = memory
            return
        limit = self.config.workers.leak_warn_mb * 2**20
        if worker.memory_growth > limit and not worker.leak_warned:
            worker.leak_warned = True
            log.warning(
                "worker%d: memory grew %.0f MiB over its level after warm-up (more than workers.leak_warn_mb = %g); "
                "a model that keeps tensors between batches leaks like this", worker.index,
                worker.memory_growth / 2**20, self.config.workers.leak_warn_mb,
            )

    def versions_changed(self, worker: WorkerHandle) -> None:
        """A version was loaded or freed on `worker`: its memory level after warm-up is measured anew."""
        worker.memory_baseline = None
        worker.leak_warned = False

    def executors_for(self, model: str, version: str) -> list[ExecutorHandle]:
        """Executors that can run `version` of `model` now (said hello, on a ready worker that has it)."""
        return [
            executor
            for worker in self.workers
            if worker.serves(model, version) and worker.slots.free
            for executor in worker.executors
            if executor.identity is not None
        ]

    def send_control(self, worker: WorkerHandle, message: messages.Message) -> bool:
        """Send to a worker's main thread (load, unload, shutdown)."""
        return worker.control is not None and self.send(worker.control, message)

    def reap(self, worker: WorkerHandle, now: float, retry: bool) -> str:
        """Collect an exited process; schedule its replacement with backoff, or give up.

        `retry` is False while the daemon starts: a worker that cannot start then
        is given up at once, so a broken model fails the start instead of looping.
        Returns the reason of the exit, for the requests it leaves unanswered.
        """
        process = worker.process
        process.join(timeout=1.0)
        code = process.exitcode
        was = worker.state
        for identity in [i for i, role in self._roles.items() if role[0] is worker]:
            del self._roles[identity]
        worker.process = None
        worker.control = None
        worker.executors = []
        reason = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if code == -signal.SIGKILL:
            reason += " (perhaps out of memory?)"
        if was == STOPPING and not worker.give_up:
            worker.state = DEAD
            log.info("worker%d exited (%s)", worker.index, reason)
            return reason
        if worker.hung:
            reason = f"{worker.hung}; it was killed ({reason})"
            worker.last_error, worker.hung = worker.hung, None
        worker.deaths.append(now)
        while worker.deaths and now - worker.deaths[0] > CRASH_WINDOW_S:
            worker.deaths.popleft()
        crashes = len(worker.deaths)
        if not retry or worker.give_up or crashes > self.config.workers.max_restarts:
            worker.state = FAILED
            why = "it cannot start" if not retry else f"{crashes} deaths within {CRASH_WINDOW_S:g} s"
            log.error("worker%d given up (%s): %s", worker.index, why, worker.last_error or reason)
            return reason
        worker.restarts += 1
        # The first death restarts at once; a worker that keeps dying waits longer each time.
        delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (crashes - 2)) if crashes > 1 else 0.0
        worker.state = DEAD
        worker.respawn_at = now + delay
        log.error("worker%d (%s) died: %s; restarting in %.1f s", worker.index, was, reason, delay)
        return reason

    def abort_hung(self, worker: WorkerHandle, why: str, now: float) -> None:
        """A worker stuck in a batch: SIGABRT (its Python stacks go to the log), then SIGKILL."""
        if worker.process is None or worker.process.pid is None:
            return
        if worker.hung is None:
            worker.hung, worker.hung_since = why, now
            log.error("worker%d is hung: %s; aborting it", worker.index, why)
            try:
                os.kill(worker.process.pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        elif now - worker.hung_since > ABORT_GRACE_S:
            self.kill(worker)

    def housekeeping(self, now: float, respawn: bool) -> None:
        """Kill workers that boot too long; respawn dead ones whose backoff has passed."""
        for worker in self.workers:
            if worker.state == BOOTING and now - worker.started > self.config.workers.start_timeout_s:
                worker.last_error = f"did not become ready within {self.config.workers.start_timeout_s:g} s"
                log.error("worker%d %s; killing it", worker.index, worker.last_error)
                self.kill(worker)
            elif worker.state == STOPPING and now - worker.stopping_since > STOP_TIMEOUT_S:
                log.warning("worker%d did not stop within %g s; killing it", worker.index, STOP_TIMEOUT_S)
                self.kill(worker)
            elif respawn and worker.state == DEAD and worker.process is None and now >= worker.respawn_at:
                self.spawn(worker, now)

    def kill(self, worker: WorkerHandle) -> None:
        """SIGKILL the worker's process; its sentinel then reports the death."""
        if worker.process is not None and worker.process.pid is not None:
            try:
                os.kill(worker.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, worker: WorkerHandle, give_up: bool = False) -> None:
        """Ask a worker to exit once its executors finish what they run.

        `give_up`: the worker cannot serve this config; do not replace it.
        """
        worker.give_up = worker.give_up or give_up
        if worker.process is None:
            worker.state = FAILED if worker.give_up else DEAD
            return
        worker.state = STOPPING
        worker.stopping_since = time.monotonic()
        if not self.send_control(worker, messages.Shutdown()):
            self.kill(worker)

    def wait_all(self, timeout: float) -> None:
        """Wait for every process to exit, killing the ones that outlast `timeout`."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            if worker.process is None:
                continue
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                log.warning("worker%d did not stop in time; killing it", worker.index)
                self.kill(worker)
                worker.process.join(5.0)
            worker.process = None
            worker.state = DEAD

    def _on_hello(self, identity: bytes, hello: messages.Hello) -> None:
        if not 0 <= hello.worker < len(self.workers):
            return
        worker = self.workers[hello.worker]
        if hello.generation != worker.generation:
            return
        if hello.executor is None:
            worker.control = identity
            self._roles[identity] = (worker, hello.generation, None)
        elif 0 <= hello.executor < len(worker.executors):
            executor = worker.executors[hello.executor]
            executor.identity = identity
            self._roles[identity] = (worker, hello.generation, executor)
