"""The worker table: spawn, hand-shake, reap and respawn worker processes; the one writer of their records.

Each worker is bound to one device and one arena for the daemon's lifetime;
its process may be replaced, and each replacement carries a new generation.
A Python model's processes (steps: one executor each, under the model's own
interpreter) are workers of a second kind in the same table, supervised the
same way: a Python model is placed only on its own steps, and a tensor model
never on a step.
Messages from a generation that is gone are ignored, so a late message from a
dead process can never be taken for its successor's. Every change to a
worker's record (what it has loaded, what it runs, why it cannot serve) goes
through a method of this table.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import ClassVar

import msgspec
import zmq

from inferd.compute.process import ProcessSpec
from inferd.config import loading
from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.ipc.arena import Arena, ArenaError, arena_name
from inferd.ipc.messages import LoadedModel
from inferd.ipc.slots import SlotPool, slot_shortfall
from inferd.ipc.sockets import send_parts
from inferd.models import unpad
from inferd.models.repository import RepositoryError, python_version
from inferd.supervisor.processes.children import CRASH_WINDOW_S, FORKED, ChildProcess
from inferd.supervisor.shared.live import LiveVersions
from inferd.supervisor.shared.state import StartupError
from inferd.system.paths import RuntimeFiles
from inferd.worker.exits import WorkerExit, describe_exit
from inferd.worker.main import worker_main

log = logging.getLogger("inferd.workers")

PIPELINE_DEPTH = 2  # batches an executor may hold: one running, one waiting behind it
ABORT_GRACE_S = 2.0  # a hung worker gets SIGABRT, then SIGKILL this much later


def _arena(instance: str, index: int, size: int) -> Arena:
    """The arena of the table's process `index`, made now; StartupError when it cannot be."""
    try:
        return Arena.create(arena_name(instance, index), size)
    except (ArenaError, OSError) as exc:
        raise StartupError(f"cannot create the shared-memory arenas: {exc}") from None


class WorkerState(StrEnum):
    """Where one worker slot is; the value is what status says."""

    BOOTING = "booting"  # a process is loading and warming the live versions
    READY = "ready"  # its executors take batches
    REPLACING = "replacing"  # hung in a load: takes no new batch, killed once its batches are back
    STOPPING = "stopping"  # told to exit
    DEAD = "dead"  # no process; one is started when its backoff has passed
    FAILED = "failed"  # given up: it is not started again


@dataclass(eq=False)
class ExecutorHandle:
    """One executor of a worker, as the dispatcher sees it."""

    worker: WorkerHandle
    index: int
    identity: bytes | None = None
    inflight: int = 0  # batches it holds
    requests: int = 0  # requests in those batches
    last_used: float = 0.0  # when it was last sent a batch (monotonic)
    expected: deque[float] = field(default_factory=deque)  # compute seconds expected of each batch it holds
    busy_since: float = 0.0  # when it started on the first of them (monotonic)

    def free_at(self) -> float:
        """When it is expected to have computed every batch it holds (monotonic; 0 when it holds none)."""
        return self.busy_since + sum(self.expected) if self.inflight else 0.0


@dataclass(eq=False)
class WorkerHandle(ChildProcess):
    """One worker slot: a device, an arena, and the process currently serving them."""

    starter: ClassVar[SpawnContext | ForkServerContext] = FORKED
    kind: ClassVar[str] = "worker"  # what status calls it
    index: int
    device: str
    arena: Arena
    slots: SlotPool
    stacks_path: Path
    generation: int = 0
    state: WorkerState = WorkerState.DEAD
    control: bytes | None = None
    executors: list[ExecutorHandle] = field(default_factory=list)
    loaded: dict[tuple[str, str], LoadedModel] = field(default_factory=dict)  # (model, version) -> signature
    loading: dict[tuple[str, str], float] = field(default_factory=dict)  # (model, version) -> when it was asked
    # The on-demand models placed here (placement.py), each with when a batch of it was last sent here.
    placed: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    batches: int = 0
    last_error: str = ""
    give_up: bool = False
    stopping_since: float = 0.0
    hung: str | None = None  # why it is being aborted as hung
    hung_since: float = 0.0
    memory: int = 0  # after its last batch: device bytes allocated on a GPU, resident bytes on the CPU
    reserved: int = 0  # GPU allocator's reserved bytes
    memory_baseline: int | None = None  # `memory` after warm-up; None until a batch sets it
    leak_warned: bool = False
    boot_s: float = 0.0  # what its last start took, spawn to ready (0 before the first)
    ping_sent: float | None = None  # when the Ping not answered yet was sent (monotonic)
    pinged_at: float = 0.0  # when the last Ping was answered, or sent
    ping_ms: float | None = None  # the last Ping's round trip

    @property
    def memory_growth(self) -> int:
        """Bytes the worker's memory grew over its level after warm-up."""
        return 0 if self.memory_baseline is None else max(0, self.memory - self.memory_baseline)

    @property
    def model_memory(self) -> int:
        """Bytes its loaded versions hold, as each measured itself after warm-up."""
        return sum(loaded.memory for loaded in self.loaded.values())

    @property
    def inflight(self) -> int:
        """Batches its executors hold."""
        return sum(e.inflight for e in self.executors)

    @property
    def requests_in_flight(self) -> int:
        """Requests in the batches its executors hold."""
        return sum(e.requests for e in self.executors)

    @property
    def name(self) -> str:
        """How the log, errors and status name it."""
        return f"worker{self.index}"

    def title(self) -> str:
        """Its process's title in ps."""
        return f"inferd: {self.name} gen{self.generation} {self.device}"

    def lanes(self, config: Config) -> int:
        """How many executors its process runs: one per stream."""
        return config.workers.streams

    def launch(self, spec: ProcessSpec, config: Config) -> int:
        """Start its process with `spec`, forked from the workers' fork server; its pid."""
        return self.spawn(worker_main, msgspec.msgpack.encode(spec), f"inferd-{self.name}")

    def serves(self, model: str, version: str) -> bool:
        """True when this worker is ready and has `version` of `model` loaded and warmed."""
        return self.state == WorkerState.READY and (model, version) in self.loaded

    def expected_back(self, now: float) -> float | None:
        """When it is expected to be ready (monotonic): a restart's backoff, then as long as its last start
        took; None when it will not be (given up, or stopping)."""
        if self.state == WorkerState.READY:
            return now
        if self.state == WorkerState.DEAD:
            return max(now, self.respawn_at) + self.boot_s
        if self.state == WorkerState.BOOTING:
            return max(now, self.started + self.boot_s)
        if self.state == WorkerState.REPLACING:  # killed once its batches are back, then started again at once
            return now + self.boot_s
        return None


# Thread pools a numerical library in a step may start, held to workers.cpu_threads as a CPU worker's torch is:
# a pool per core in each of many processes would only fight over the cores.
THREAD_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
INFERD_HOME = Path(__file__).resolve().parents[3]  # the folder the running inferd package was imported from


@dataclass(eq=False)
class StepHandle(WorkerHandle):
    """One process of a Python model's pool, `inferd: step MODEL.NUMBER`: a worker of one executor on the CPU,
    started from the command line of the model's interpreter (models.MODEL.python, else the daemon's own)."""

    kind: ClassVar[str] = "step"
    model: str = ""
    number: int = 0

    @property
    def name(self) -> str:
        """How the log, errors and status name it."""
        return f"step {self.model}.{self.number}"

    def title(self) -> str:
        """Its process's title in ps."""
        return f"inferd: {self.name}"

    def lanes(self, config: Config) -> int:
        """One executor: a step's CPU work scales with processes (models.MODEL.processes), not threads."""
        return 1

    def launch(self, spec: ProcessSpec, config: Config) -> int:
        """Start its process: `python -m inferd.step` under the model's interpreter, the spec on its stdin."""
        python = config.models[self.model].python
        env = {name: str(config.workers.cpu_threads) for name in THREAD_POOLS if name not in os.environ}
        if python:
            # The daemon's PYTHONPATH is for the daemon's interpreter (it may lead to torch): another interpreter
            # imports its own packages only.
            env["PYTHONPATH"] = ""
        elif INFERD_HOME.name not in ("site-packages", "dist-packages"):
            # Under the daemon's own interpreter, a step finds inferd where the daemon did (a checkout too).
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INFERD_HOME), os.environ.get("PYTHONPATH")]))
        return self.start_command([python or sys.executable, "-m", "inferd.step"], msgspec.msgpack.encode(spec), env)


def step_pools(config: Config, live: dict[str, str]) -> dict[str, int]:
    """The Python models among those served (their live version holds model.py), each with its processes."""
    pools = {}
    for name, version in live.items():
        try:
            python = python_version(config.models[name], version)
        except RepositoryError:
            continue  # the load says what is wrong
        if python:
            pools[name] = config.models[name].processes
    return pools


class WorkerTable:
    """Every worker of the daemon, and the backend socket they talk to it on."""

    def __init__(self, config: Config, context: zmq.Context, devices: list[str], files: RuntimeFiles,
                 live: LiveVersions, pools: dict[str, int] | None = None) -> None:
        self.config = config
        self.devices = devices
        self.pools = pools or {}  # each Python model's processes (step_pools)
        self._instance = ""  # the supervisor's, which names the arenas (open)
        self.files = files
        self.live = live
        self.endpoint = f"ipc://{files.backend}"
        self.backend = context.socket(zmq.ROUTER)
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.backend.linger = 0
        self.workers: list[WorkerHandle] = []
        self._roles: dict[bytes, tuple[WorkerHandle, int, ExecutorHandle | None]] = {}
        # The outputs of each version some worker has loaded, kept when none has it any more (an on-demand
        # model unloaded still has them).
        self._signatures: dict[tuple[str, str], tuple[messages.TensorSpec, ...]] = {}
        self._bound = False

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): restart limits, timeouts, the leak watch, model configs for spawns."""
        self.config = config

    def open(self, instance: str) -> None:
        """Create every worker's and step's arena and bind the backend socket (before any process starts)."""
        self._instance = instance
        size = self.config.workers.shm_mb << 20
        slot_count = PIPELINE_DEPTH * self.config.workers.streams
        for index, device in enumerate(self.devices):
            self.workers.append(WorkerHandle(index=index, device=device, arena=_arena(instance, index, size),
                                             slots=SlotPool(size, slot_count),
                                             stacks_path=self.files.worker_stacks(index)))
        for model, count in self.pools.items():
            self._add_steps(model, range(count))
        self.files.backend.parent.mkdir(parents=True, exist_ok=True)
        self.backend.bind(self.endpoint)
        self._bound = True
        os.chmod(self.files.backend, 0o600)

    def _add_steps(self, model: str, numbers: range) -> None:
        """The handles of Python model `model`'s processes `numbers`, each with its arena (PIPELINE_DEPTH slots of
        a worker's size), in the table; StartupError when an arena cannot be made."""
        worker_slots = SlotPool(self.config.workers.shm_mb << 20, PIPELINE_DEPTH * self.config.workers.streams)
        size = PIPELINE_DEPTH * worker_slots.slot_size
        for number in numbers:
            index = len(self.workers)
            self.workers.append(StepHandle(index=index, device="cpu", arena=_arena(self._instance, index, size),
                                           slots=SlotPool(size, PIPELINE_DEPTH),
                                           stacks_path=self.files.step_stacks(model, number), model=model,
                                           number=number))

    def add_steps(self, model: str, count: int) -> None:
        """`count` processes more for Python model `model` (a SIGHUP added it, or raised its `processes`): their
        handles and arenas, which respawn_due starts; StartupError (nothing added) when an arena cannot be made."""
        before, first = len(self.workers), self.pools.get(model, 0)
        try:
            self._add_steps(model, range(first, first + count))
        except StartupError:
            for worker in self.workers[before:]:
                worker.arena.close()
                worker.arena.unlink()
            del self.workers[before:]
            raise
        self.pools[model] = first + count

    def close(self) -> None:
        """Close the backend socket, unmap and unlink every arena, remove the stacks files."""
        self.backend.close(linger=0)
        if self._bound:
            self.files.backend.unlink(missing_ok=True)
        for worker in self.workers:
            worker.arena.close()
            worker.arena.unlink()
            worker.stacks_path.unlink(missing_ok=True)

    # -- processes --------------------------------------------------------------

    def spawn(self, worker: WorkerHandle, now: float) -> None:
        """Start a new process, of a new generation, for `worker`; one that cannot be started is given up."""
        worker.generation += 1
        spec = ProcessSpec(
            worker=worker.index,
            generation=worker.generation,
            device=worker.device,
            backend=self.endpoint,
            arena=worker.arena.name,
            config=loading.encode(self.config),
            versions={model: version for model, version in self.live.items()
                      if not self.config.models[model].on_demand and self.holds(worker, model)},
            stacks=str(worker.stacks_path),
            title=worker.title(),
            component=worker.name.replace(" ", "-"),
        )
        try:
            pid = worker.launch(spec, self.config)
        except OSError as exc:  # a step's interpreter gone since the config was checked, say
            worker.last_error = f"its process could not be started: {exc}"
            self._give_up(worker, "it cannot start", worker.last_error)
            return
        worker.state = WorkerState.BOOTING
        worker.started = now
        worker.control = None
        worker.loaded = {}
        worker.loading = {}
        worker.placed = {}
        worker.memory_baseline = None
        worker.leak_warned = False
        worker.ping_sent, worker.pinged_at, worker.ping_ms = None, 0.0, None
        worker.executors = [ExecutorHandle(worker, k) for k in range(worker.lanes(self.config))]
        log.info("%s generation %d started on %s, pid %d", worker.name, worker.generation, worker.device, pid)

    def respawn_due(self, now: float) -> None:
        """Start a process for every dead worker whose backoff has passed."""
        for worker in self.workers:
            if worker.state == WorkerState.DEAD and worker.process is None and now >= worker.respawn_at:
                self.spawn(worker, now)

    def reap(self, worker: WorkerHandle, now: float, retry: bool) -> str:
        """Collect an exited process; schedule its replacement with backoff, or give up.

        `retry` is False while the daemon starts: a worker that cannot start then
        is given up at once, so a broken model fails the start instead of looping.
        A worker that exits saying it could not load its models is given up too: a
        new process would fail the same way. Returns the reason of the exit, for the
        requests it leaves unanswered.
        """
        code = worker.exited()
        was = worker.state
        for identity in [i for i, role in self._roles.items() if role[0] is worker]:
            del self._roles[identity]
        worker.control = None
        worker.executors = []
        worker.loading = {}
        worker.placed = {}  # its on-demand models are placed again, where requests need them
        hung, worker.hung = worker.hung, None
        reason = describe_exit(code)
        if was == WorkerState.STOPPING and not worker.give_up:
            worker.state = WorkerState.DEAD
            log.info("%s exited (%s)", worker.name, reason)
            return reason
        if was == WorkerState.REPLACING:
            worker.restarts += 1
            worker.state, worker.respawn_at = WorkerState.DEAD, now
            log.warning("%s replaced (%s): %s", worker.name, reason, worker.last_error)
            return f"{worker.last_error}; it was replaced"
        if hung:
            reason = f"{hung}; it was killed ({reason})"
            worker.last_error = hung
        cannot_boot = code == WorkerExit.BOOT_ERROR
        if not retry or cannot_boot or worker.give_up:
            return self._give_up(worker, "it cannot start" if not retry or cannot_boot else
                                 "it cannot serve this config", reason)
        delay = worker.crashed(now, self.config.workers.max_restarts)
        if delay is None:
            return self._give_up(worker, f"{len(worker.deaths)} deaths within {CRASH_WINDOW_S:g} s", reason)
        worker.state = WorkerState.DEAD
        log.error("%s (%s) died: %s; restarting in %.1f s", worker.name, was, reason, delay)
        return reason

    def _give_up(self, worker: WorkerHandle, why: str, reason: str) -> str:
        worker.state = WorkerState.FAILED
        log.error("%s given up (%s): %s", worker.name, why, worker.last_error or reason)
        return reason

    def abort_hung(self, worker: WorkerHandle, why: str, now: float) -> None:
        """A worker hung in a batch: SIGABRT (its Python stacks go to the log), then SIGKILL."""
        if worker.process is None or worker.process.pid is None:
            return
        if worker.hung is None:
            worker.hung, worker.hung_since = why, now
            log.error("%s is hung: %s; aborting it", worker.name, why)
            worker.signal(signal.SIGABRT)
        elif now - worker.hung_since > ABORT_GRACE_S:
            worker.kill()

    def replace(self, worker: WorkerHandle, why: str) -> None:
        """Take a worker whose loader hung out of service; it is killed once its batches are back
        (see Liveness) and a new process takes its place."""
        if worker.state not in (WorkerState.READY, WorkerState.BOOTING):
            return
        worker.last_error = why
        worker.state = WorkerState.REPLACING
        worker.loading = {}
        log.error("%s: %s; replacing it once its running batches are back", worker.name, why)

    def stop(self, worker: WorkerHandle, give_up: bool = False) -> None:
        """Ask a worker to exit once its executors finish what they run.

        `give_up`: the worker cannot serve this config; do not replace it.
        """
        worker.give_up = worker.give_up or give_up
        if worker.process is None:
            worker.state = WorkerState.FAILED if worker.give_up else WorkerState.DEAD
            return
        worker.state = WorkerState.STOPPING
        worker.stopping_since = time.monotonic()
        if not self.send_control(worker, messages.Shutdown()):
            worker.kill()

    def wait_all(self, timeout: float) -> None:
        """Wait for every process to exit, killing the ones that outlast `timeout`."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            if worker.process is None:
                continue
            if worker.wait_or_kill(deadline - time.monotonic()):
                log.warning("%s did not stop in time; killing it", worker.name)
            worker.state = WorkerState.DEAD

    # -- messages ---------------------------------------------------------------

    def send(self, identity: bytes | None, message: messages.Message) -> bool:
        """Send to one worker socket; False when that socket is gone."""
        if identity is None:
            return False
        try:
            send_parts(self.backend, [identity, messages.encode(message)])
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot reach worker socket %r: %s", identity, exc.strerror)
            return False

    def send_control(self, worker: WorkerHandle, message: messages.Message) -> bool:
        """Send to a worker's main thread (load, unload, shutdown)."""
        return self.send(worker.control, message)

    def unreachable(self, executor: ExecutorHandle) -> None:
        """`executor`'s socket cannot be reached (its process is gone, and its exit is not news to the loop yet):
        no batch is sent there again (what it may still answer is read as before)."""
        executor.identity = None

    def trim_memory(self, why: str) -> list[int]:
        """Ask every ready worker to return its unused GPU memory now; the indexes of those asked."""
        asked = [w.index for w in self.device_workers
                 if w.state == WorkerState.READY and self.send_control(w, messages.TrimMemory())]
        log.info("trim asked by %s: %d workers asked to return unused GPU memory", why, len(asked))
        return asked

    def worker_of(self, identity: bytes) -> WorkerHandle | None:
        """The worker behind a socket identity, if it belongs to a live generation."""
        role = self._live_role(identity)
        return None if role is None else role[0]

    def executor_of(self, identity: bytes) -> ExecutorHandle | None:
        """The executor behind a socket identity, if it belongs to a live generation."""
        role = self._live_role(identity)
        return None if role is None else role[2]

    def _live_role(self, identity: bytes) -> tuple[WorkerHandle, int, ExecutorHandle | None] | None:
        role = self._roles.get(identity)
        return None if role is None or role[0].generation != role[1] else role

    def on_message(self, identity: bytes, message: messages.Message) -> WorkerHandle | None:
        """Handle a lifecycle message; return the worker that became ready, if any."""
        if isinstance(message, messages.Hello):
            self._on_hello(identity, message)
            return None
        worker = self.worker_of(identity)
        if worker is None:
            return None
        if isinstance(message, messages.Ready) and worker.state == WorkerState.BOOTING:
            for name, loaded in message.models.items():
                problem = self.version_loaded(worker, name, loaded)
                if problem is not None:
                    self.cannot_serve(worker, problem)
                    return None
            worker.state = WorkerState.READY
            worker.boot_s = time.monotonic() - worker.started
            log.info("%s ready on %s (pid %d) in %.1f s", worker.name, worker.device, message.pid,
                     worker.boot_s)
            return worker
        if isinstance(message, messages.BootFailed):
            worker.last_error = message.error
            log.error("%s failed to boot: %s", worker.name, message.error)
        elif isinstance(message, messages.Pong):
            if message.sent == worker.ping_sent:  # an answer to a Ping forgotten since is no news
                worker.ping_sent, worker.pinged_at = None, time.monotonic()
                worker.ping_ms = (worker.pinged_at - message.sent) * 1000
        elif isinstance(message, messages.Trimmed):
            worker.memory, worker.reserved = message.memory, message.reserved
        return None

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

    # -- versions ---------------------------------------------------------------

    @property
    def device_workers(self) -> list[WorkerHandle]:
        """The workers of devices, without the Python models' steps."""
        return [w for w in self.workers if not isinstance(w, StepHandle)]

    def holds(self, worker: WorkerHandle, model: str) -> bool:
        """Whether `model`'s versions belong on `worker`: a Python model's on its own steps only; a tensor model's
        on every worker of a device (an on-demand one where it was placed), never on a step."""
        config = self.config.models.get(model)
        if config is None:
            return False
        if isinstance(worker, StepHandle) or model in self.pools:
            return isinstance(worker, StepHandle) and worker.model == model
        return not config.on_demand or model in worker.placed

    def load(self, worker: WorkerHandle, model: str, version: str, expect: tuple[messages.TensorSpec, ...] | None,
             now: float) -> bool:
        """Ask `worker` to load and warm `version` beside what it has; False when it cannot be reached."""
        message = messages.LoadVersion(model, version, self.config.models[model], expect,
                                       self.config.workers.reload_memory_factor)
        if not self.send_control(worker, message):
            return False
        worker.loading[(model, version)] = now
        return True

    def place(self, worker: WorkerHandle, model: str, now: float) -> None:
        """Put on-demand `model` on `worker`: its live version is to be loaded there (the reload manager's
        catch-up loads it)."""
        worker.placed[model] = now

    def unplace(self, worker: WorkerHandle, model: str) -> None:
        """On-demand `model` no longer belongs on `worker`; its versions there are to be unloaded."""
        worker.placed.pop(model, None)

    def model_used(self, worker: WorkerHandle, model: str, now: float) -> None:
        """A batch of `model` was sent to `worker` (an on-demand model's last use, for the LRU)."""
        if model in worker.placed:
            worker.placed[model] = now

    def load_answered(self, worker: WorkerHandle, model: str, version: str) -> None:
        """The worker answered a load (loaded or refused)."""
        worker.loading.pop((model, version), None)

    def version_loaded(self, worker: WorkerHandle, model: str, loaded: LoadedModel) -> str | None:
        """Record that `worker` has `loaded` of `model` warm, if a full batch of it fits an arena slot;
        otherwise return why not (and record nothing)."""
        spec = self.config.models[model]
        problem = slot_shortfall(model, spec, loaded.outputs, worker.slots.slot_size) or \
            unpad.unpad_problem(model, spec, loaded.outputs)
        if problem is None and len(spec.outputs) > len(loaded.outputs):
            problem = (f"models.{model}.outputs names {len(spec.outputs)} outputs, but {model} {loaded.version} "
                       f"returns {len(loaded.outputs)}")
        for index, (declared, found) in enumerate(zip(spec.outputs, loaded.outputs)):
            if problem is None and declared.declared and \
                    (declared.dtype, list(declared.shape or ())) != (found.dtype, found.public_shape()):
                problem = (f"models.{model}.outputs: output {index} is declared {declared.dtype} "
                           f"{list(declared.shape or ())}, but {model} {loaded.version} returns {found.dtype} "
                           f"{found.public_shape()}")
        if problem is not None:
            return f"{worker.name}: {problem}"
        worker.loaded[(model, loaded.version)] = loaded
        self._signatures[(model, loaded.version)] = loaded.outputs
        self._versions_changed(worker)
        return None

    def version_unloaded(self, worker: WorkerHandle, model: str, version: str) -> None:
        """Have `worker` free `version` of `model`; no batch of it may be sent there again."""
        worker.loaded.pop((model, version), None)
        self.send_control(worker, messages.UnloadVersion(model, version))
        self._versions_changed(worker)

    def cannot_serve(self, worker: WorkerHandle, why: str) -> None:
        """`worker` cannot serve this config at all: stop it and do not start it again."""
        worker.last_error = why
        log.error("%s", why)
        self.stop(worker, give_up=True)

    def note_error(self, worker: WorkerHandle, error: str) -> None:
        """The last thing that went wrong on `worker`, for status."""
        worker.last_error = error

    def signature(self, model: str, version: str) -> tuple[messages.TensorSpec, ...] | None:
        """The outputs of `version` of `model`, as a worker loaded it (None before any has)."""
        return self._signatures.get((model, version))

    def _versions_changed(self, worker: WorkerHandle) -> None:
        # Its memory level after warm-up is measured anew.
        worker.memory_baseline = None
        worker.leak_warned = False

    # -- batches ----------------------------------------------------------------

    def executors_serving(self, model: str, version: str) -> list[ExecutorHandle]:
        """Executors that serve `version` of `model`, busy or not (said hello, on a ready worker that has it,
        among the executors the worker runs it on)."""
        return [
            executor
            for worker in self.workers
            if worker.serves(model, version)
            for executor in worker.executors[:worker.loaded[(model, version)].lanes or None]
            if executor.identity is not None
        ]

    def executors_for(self, model: str, version: str) -> list[ExecutorHandle]:
        """Executors that can run `version` of `model` now: those serving it on a worker with a free slot."""
        return [executor for executor in self.executors_serving(model, version) if executor.worker.slots.free]

    def batch_sent(self, executor: ExecutorHandle, requests: int, now: float, expected_s: float) -> None:
        """`executor` holds one more batch, of `requests` requests, expected to compute in `expected_s`."""
        if not executor.inflight:
            executor.busy_since = now
        executor.inflight += 1
        executor.requests += requests
        executor.last_used = now
        executor.expected.append(expected_s)

    def batch_returned(self, executor: ExecutorHandle, requests: int, computed: bool, now: float) -> None:
        """A batch of `executor`'s is back (or lost with its worker); `computed`: it ran."""
        executor.inflight -= 1
        executor.requests -= requests
        # Batches come back in the order they were sent: the next one starts now.
        executor.expected.popleft()
        executor.busy_since = now
        if computed:
            executor.worker.batches += 1

    def note_memory(self, worker: WorkerHandle, memory: int, reserved: int, growth: int,
                    batch: Callable[[], str]) -> None:
        """The leak watch: a worker's memory after a batch, against its level after warm-up, and what
        the batch (`batch()` names it) alone grew it by."""
        worker.memory, worker.reserved = memory, reserved
        limit = self.config.workers.leak_warn_mb * 2**20
        if growth > limit:
            log.warning("%s on %s grew its memory by %.0f MiB (more than workers.leak_warn_mb = %g)",
                        batch(), worker.name, growth / 2**20, self.config.workers.leak_warn_mb)
        if worker.memory_baseline is None:
            worker.memory_baseline = memory
            return
        if worker.memory_growth > limit and not worker.leak_warned:
            worker.leak_warned = True
            log.warning(
                "%s: memory grew %.0f MiB over its level after warm-up (more than workers.leak_warn_mb = %g); "
                "a model that keeps tensors between batches leaks like this", worker.name,
                worker.memory_growth / 2**20, self.config.workers.leak_warn_mb,
            )
