"""The worker process: one device, its models, its executors.

Forked from the workers' fork server (preload), which never touches CUDA. It
attaches its arena, loads and warms every model, starts one executor per
stream, then reports Ready. It exits when told to, or on its own as soon as
the supervisor is gone.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import msgspec
import zmq

from inferd.config import loading
from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.system.child import begin_child
from inferd.system.logs import set_level
from inferd.system.paths import COMPILE_CACHE
from inferd.worker.exits import WorkerExit

log = logging.getLogger("inferd.worker")

LOADER_NICENESS = 10
TRIM_CHECK_MS = 1000
TRIM_FLOOR_BYTES = 64 << 20  # what an idle worker's reservation must grow by before it trims again


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker needs, handed over at spawn as msgpack."""

    worker: int
    generation: int
    device: str
    backend: str
    arena: str
    config: bytes
    versions: dict[str, str]  # the live version of each model loaded at boot
    stacks: str  # file the worker's thread stacks are written to on SIGUSR1 (inferctl stacks)


def _device(name: str):
    import torch

    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _pin(arena, device) -> bool:
    """Page-lock the arena so host-device copies are asynchronous on the executors' streams."""
    import torch

    if device.type != "cuda":
        return False
    err = torch.cuda.cudart().cudaHostRegister(arena.address(), arena.size, 0)
    if int(err) != 0:
        log.warning("could not page-lock the arena (cudaHostRegister error %s); copies will be synchronous", err)
        return False
    return True


def _unpin(arena) -> None:
    """Undo _pin; before the arena is unmapped, or the driver keeps a registration of freed memory."""
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(arena.address())
    if int(err) != 0:
        log.warning("could not unregister the arena (cudaHostUnregister error %s)", err)


def worker_main(encoded_spec: bytes) -> None:
    """Entry point of a worker process, forked from the workers' fork server."""
    spec = msgspec.msgpack.decode(encoded_spec, type=WorkerSpec)
    config = loading.decode(spec.config)
    # Read by torch.compile's inductor when it first compiles: what one worker compiled, the others (and a
    # restart) load from here. Inductor keys what it keeps by the torch version and the device.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(config.server.state_dir or "") / COMPILE_CACHE))
    begin_child(f"inferd: worker{spec.worker} gen{spec.generation} {spec.device}", f"worker{spec.worker}",
                config.server.log_level, WorkerExit.PARENT_GONE)
    # Written from the signal handler itself, so a worker hung inside a model still answers.
    stacks = open(spec.stacks, "a")  # noqa: SIM115 - open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A hung worker is aborted with SIGABRT; a crash (SIGSEGV, ...) kills it: either way its
    # Python stacks go to stderr, so the log says where it was.
    faulthandler.enable(all_threads=True)
    context = zmq.Context()
    control = context.socket(zmq.DEALER)
    control.linger = 1000
    control.connect(spec.backend)
    control.send(messages.encode(messages.Hello(spec.worker, spec.generation, None)))
    # Readable once the worker stops; every executor polls it beside its socket.
    stop_r, stop_w = os.pipe()
    try:
        arena, pinned, executors, runner, ready = _boot(spec, config, context, stop_r)
    except Exception as exc:  # noqa: BLE001 - whatever stops the boot is said in one sentence
        log.error("boot failed: %s", exc)
        control.send(messages.encode(messages.BootFailed(str(exc))))
        control.close()
        context.term()
        sys.exit(WorkerExit.BOOT_ERROR)
    # torch brings ~170k long-lived Python objects; a full collection over them
    # holds the GIL for ~130 ms and stops every executor. Freezing them keeps
    # later collections (automatic, or after an unload) down to what is new.
    gc.freeze()
    for executor in executors:
        executor.start()
    control.send(messages.encode(ready))
    log.info("ready on %s with %d executor(s), pid %d", spec.device, len(executors), os.getpid())
    # From now on this thread only loads and warms new versions: let the
    # executors, which serve the live one, have the CPU first.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
    _serve_control(control, runner, executors, config.workers.fragmentation_trim)
    os.write(stop_w, b"\0")
    for executor in executors:
        executor.join()
    if pinned:
        _unpin(arena)
    arena.close()
    control.close()
    context.term()
    log.info("stopped")
    logging.shutdown()
    # Everything this process owns is released; skip the interpreter's slow
    # teardown of torch, which would only delay the supervisor's stop.
    os._exit(0)


def _boot(spec: WorkerSpec, config: Config, context: zmq.Context, stop_fd: int):
    """Attach the arena, load and warm the models of `spec.versions`, create the executors (not yet started)."""
    import torch

    from inferd.ipc.arena import Arena
    from inferd.worker.executor import Executor, Overlap
    from inferd.worker.runner import ModelRunner

    device = _device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(config.workers.cpu_threads)
    arena = Arena.attach(spec.arena)
    pinned = _pin(arena, device)
    runner = ModelRunner(device, config.workers.streams)
    overlap = Overlap()
    executors = [
        Executor(k, context, spec.backend, messages.Hello(spec.worker, spec.generation, k), arena, runner, stop_fd,
                 overlap)
        for k in range(config.workers.streams)
    ]
    streams = [e.stream for e in executors if e.stream is not None]
    try:
        loaded = {  # the models every worker holds; on-demand ones come when a request needs them
            name: runner.load(name, config.models[name], version, streams=streams)[0]
            for name, version in spec.versions.items()
        }
    except BaseException:
        for executor in executors:  # never started: their sockets would keep the context from closing
            executor.socket.close()
        raise
    return arena, pinned, executors, runner, messages.Ready(pid=os.getpid(), device=spec.device, models=loaded)


class IdleTrim:
    """When an idle GPU worker returns its allocator's unused memory: more than `above` of what it reserves
    unused, two checks in a row, and its reservation grown by TRIM_FLOOR_BYTES since it last trimmed. What a
    trim cannot return (CUDA graphs' pools, segments a live tensor holds a part of) would otherwise look
    unused at every check, and be "trimmed" every other second for nothing."""

    def __init__(self, above: float) -> None:
        self.above = above
        self._checks = 0
        self._after_last = 0  # bytes reserved right after the last trim

    def due(self, allocated: int, reserved: int) -> bool:
        """One check: whether to trim now."""
        unused = reserved > 0 and (reserved - allocated) / reserved > self.above
        self._checks = self._checks + 1 if unused and reserved >= self._after_last + TRIM_FLOOR_BYTES else 0
        return self._checks >= 2

    def trimmed(self, reserved: int) -> None:
        """A trim left `reserved` bytes reserved."""
        self._checks = 0
        self._after_last = reserved


def _trim(control: zmq.Socket, runner) -> int:
    """Trim a GPU worker's allocator and tell the supervisor what it holds now; the bytes freed."""
    freed = runner.trim()
    control.send(messages.encode(messages.Trimmed(*runner.allocator_memory())))
    return freed


def _serve_control(control: zmq.Socket, runner, executors, trim_above: float) -> None:
    """Load and unload versions, and trim, as the supervisor asks, until it says Shutdown.

    Loading runs here, in the main thread, while the executors go on serving the
    live version; a version becomes usable only once the supervisor flips to it.
    Between messages, a GPU worker whose executors are all idle gives its
    allocator's unused memory back when IdleTrim says so.
    """
    from inferd.worker.runner import describe_error

    idle_trim = IdleTrim(trim_above)
    while True:
        if not control.poll(TRIM_CHECK_MS):
            if runner.device.type == "cuda" and not any(e.busy for e in executors):
                allocated, reserved = runner.allocator_memory()
                if idle_trim.due(allocated, reserved):
                    log.info("idle with %.0f%% of reserved GPU memory unused; returned %.1f MiB to the device",
                             (reserved - allocated) / reserved * 100, _trim(control, runner) / 2**20)
                    idle_trim.trimmed(runner.allocator_memory()[1])
            continue
        message = messages.decode(control.recv())
        if isinstance(message, messages.Shutdown):
            return
        if isinstance(message, messages.LoadVersion):
            reply: messages.VersionLoaded | messages.VersionFailed
            try:
                loaded, load_s, warm_s = runner.load(
                    message.model, message.config, message.version, message.expect, message.memory_factor,
                    [e.stream for e in executors if e.stream is not None],
                )
                reply = messages.VersionLoaded(message.model, loaded, load_s, warm_s)
            except Exception as exc:  # noqa: BLE001 - a model may raise anything; the worker must live on
                error = describe_error(exc)
                log.error("cannot load %s %s: %s", message.model, message.version, error)
                reply = messages.VersionFailed(message.model, message.version, error)
            if isinstance(reply, messages.VersionFailed):
                runner.release_memory()  # only now is the failed version's traceback gone
            control.send(messages.encode(reply))
        elif isinstance(message, messages.Ping):
            control.send(messages.encode(messages.Pong(message.sent)))
        elif isinstance(message, messages.UnloadVersion):
            runner.unload(message.model, message.version)
        elif isinstance(message, messages.SetLogLevel):
            set_level(message.level)
        elif isinstance(message, messages.TrimMemory):
            if runner.device.type == "cuda":
                log.info("asked to trim: returned %.1f MiB of unused GPU memory to the device",
                         _trim(control, runner) / 2**20)
            else:
                log.info("asked to trim: nothing to return on the CPU")
