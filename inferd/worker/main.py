"""The worker process: one device, its models, its executors.

Forked from the workers' fork server (preload), which never touches CUDA. Its
life (hello, boot, ready, the supervisor's control messages, stop) is every
compute process's (inferd.compute.process); what is a worker's own is here: it
attaches its arena (page-locked on a GPU), loads and warms every model with
torch, makes one executor per stream, and returns unused GPU memory when idle.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from inferd.compute.executor import Executor as AnyExecutor
from inferd.compute.process import Booted, ProcessSpec, run_process
from inferd.config import loading
from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.system.paths import COMPILE_CACHE

log = logging.getLogger("inferd.worker")

TRIM_FLOOR_BYTES = 64 << 20  # what an idle worker's reservation must grow by before it trims again


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
    spec = msgspec.msgpack.decode(encoded_spec, type=ProcessSpec)
    config = loading.decode(spec.config)
    # Read by torch.compile's inductor when it first compiles: what one worker compiled, the others (and a
    # restart) load from here. Inductor keys what it keeps by the torch version and the device.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(config.server.state_dir or "") / COMPILE_CACHE))
    run_process(spec, config, _boot)


def _boot(spec: ProcessSpec, config: Config, context: zmq.Context, stop_fd: int) -> Booted:
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

    def release() -> None:
        if pinned:
            _unpin(arena)
        arena.close()

    return Booted(list(executors), WorkerHost(runner, streams, config.workers.fragmentation_trim),
                  messages.Ready(pid=os.getpid(), device=spec.device, models=loaded), release)


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


class WorkerHost:
    """A worker's answers to the supervisor's control messages (inferd.compute.process.Runner): versions loaded
    and warmed on each executor's stream, and a GPU's unused memory returned when asked, or when its
    executors are all idle and IdleTrim says so."""

    def __init__(self, runner, streams: list, trim_above: float) -> None:
        self.runner = runner
        self.streams = streams  # the executors' CUDA streams (none on the CPU)
        self._idle_trim = IdleTrim(trim_above)

    def load_version(self, message: messages.LoadVersion) -> tuple[messages.LoadedModel, float, float]:
        """Load and warm a version on each executor's stream (ModelRunner.load)."""
        return self.runner.load(message.model, message.config, message.version, message.expect,
                                message.memory_factor, self.streams)

    def unload(self, model: str, version: str) -> None:
        """Free a version (ModelRunner.unload)."""
        self.runner.unload(model, version)

    def release_memory(self) -> None:
        """Collect what a failed load left; on a GPU return its cached blocks."""
        self.runner.release_memory()

    def idle(self, control: zmq.Socket, executors: Sequence[AnyExecutor]) -> None:
        """A GPU worker whose executors are all idle gives its allocator's unused memory back when IdleTrim
        says so."""
        if self.runner.device.type != "cuda" or any(e.busy for e in executors):
            return
        allocated, reserved = self.runner.allocator_memory()
        if self._idle_trim.due(allocated, reserved):
            log.info("idle with %.0f%% of reserved GPU memory unused; returned %.1f MiB to the device",
                     (reserved - allocated) / reserved * 100, self._trim(control) / 2**20)
            self._idle_trim.trimmed(self.runner.allocator_memory()[1])

    def trim(self, control: zmq.Socket) -> None:
        """Asked to trim: a GPU worker returns its unused GPU memory now."""
        if self.runner.device.type == "cuda":
            log.info("asked to trim: returned %.1f MiB of unused GPU memory to the device", self._trim(control) / 2**20)
        else:
            log.info("asked to trim: nothing to return on the CPU")

    def _trim(self, control: zmq.Socket) -> int:
        """Trim the GPU allocator and tell the supervisor what it holds now; the bytes freed."""
        freed = self.runner.trim()
        control.send(messages.encode(messages.Trimmed(*self.runner.allocator_memory())))
        return freed
