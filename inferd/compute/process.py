"""A compute process's life (a worker's, or a Python model's step's): what the two kinds share.

Started by the supervisor with a ProcessSpec, it says Hello on the backend socket, has its kind boot (attach the
arena, load and warm the live versions, make the executors), reports Ready (or BootFailed, and exits
BOOT_ERROR), and then serves the supervisor's control messages in its main thread while the executors serve
batches: it loads and unloads versions, answers pings, trims, and stops when told. It exits on its own as soon
as the supervisor is gone.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import msgspec
import zmq

from inferd.compute.executor import Executor, describe_error, exception_text
from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.system.child import begin_child
from inferd.system.logs import set_level
from inferd.worker.exits import WorkerExit

log = logging.getLogger("inferd.compute.process")

LOADER_NICENESS = 10
IDLE_CHECK_MS = 1000  # how often a process with no control message to serve looks at itself (a GPU's idle trim)


class ProcessSpec(msgspec.Struct, frozen=True):
    """Everything a compute process needs, handed over at its start as msgpack."""

    worker: int  # its place in the supervisor's worker table
    generation: int
    device: str
    backend: str
    arena: str
    config: bytes
    versions: dict[str, str]  # the live version of each model loaded at boot
    stacks: str  # file the process's thread stacks are written to on SIGUSR1 (inferctl stacks)
    title: str  # its title in ps
    component: str  # what its log lines say they come from


def handed_over(spec: bytes) -> bytes:
    """`spec` as a process started from a command line (a step) reads it on its standard input: read_spec."""
    return struct.pack("<I", len(spec)) + spec


def read_spec(fd: int) -> bytes:
    """The spec the supervisor wrote to `fd` (a step's standard input) with handed_over."""
    def read(count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = os.read(fd, count - len(data))
            if not chunk:
                raise EOFError("the supervisor went away before it had handed over the spec")
            data += chunk
        return data

    return read(struct.unpack("<I", read(4))[0])


class Runner(Protocol):
    """What a kind of compute process does with the supervisor's control messages."""

    def load_version(self, message: messages.LoadVersion) -> tuple[messages.LoadedModel, float, float]:
        """Load and warm a version beside what is loaded (its signature, the seconds each took); any exception
        refuses it."""
        ...

    def unload(self, model: str, version: str) -> None:
        """Free a version."""
        ...

    def release_memory(self) -> None:
        """Give back what a failed load left."""
        ...

    def idle(self, control: zmq.Socket, executors: Sequence[Executor]) -> None:
        """No control message came for IDLE_CHECK_MS."""
        ...

    def trim(self, control: zmq.Socket) -> None:
        """The supervisor asks for unused memory back now."""
        ...


class Booted(NamedTuple):
    """What a kind's boot made: its executors (not started yet), its runner, the Ready to send, and what to
    release once the executors have stopped."""

    executors: list[Executor]
    runner: Runner
    ready: messages.Ready
    release: Callable[[], None]


Boot = Callable[[ProcessSpec, Config, zmq.Context, int], Booted]


def run_process(spec: ProcessSpec, config: Config, boot: Boot, parent_fd: int | None = None) -> None:
    """The process from its Hello to its exit: `boot(spec, config, context, stop_fd)` makes the executors, whose
    loops end once `stop_fd` is readable. `parent_fd` is readable once the supervisor is gone (else
    multiprocessing's parent sentinel says so)."""
    begin_child(spec.title, spec.component, config.server.log_level, WorkerExit.PARENT_GONE, parent_fd)
    # Written from the signal handler itself, so a process hung inside a model still answers.
    stacks = open(spec.stacks, "a")  # noqa: SIM115 - open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A hung process is aborted with SIGABRT; a crash (SIGSEGV, ...) kills it: either way its
    # Python stacks go to stderr, so the log says where it was.
    faulthandler.enable(all_threads=True)
    context = zmq.Context()
    control = context.socket(zmq.DEALER)
    control.linger = 1000
    control.connect(spec.backend)
    control.send(messages.encode(messages.Hello(spec.worker, spec.generation, None)))
    # Readable once the process stops; every executor polls it beside its socket.
    stop_r, stop_w = os.pipe()
    try:
        booted = boot(spec, config, context, stop_r)
    # Not only Exception: a sys.exit() in code a model file runs as it loads (a pickle's) would end the
    # process, saying only its exit code.
    except BaseException as exc:  # noqa: BLE001 - whatever stops the boot is said in one sentence
        error = str(exc) if isinstance(exc, Exception) else exception_text(exc)
        log.error("boot failed: %s", error)
        control.send(messages.encode(messages.BootFailed(error)))
        control.close()
        context.term()
        sys.exit(WorkerExit.BOOT_ERROR)
    # torch brings ~170k long-lived Python objects; a full collection over them
    # holds the GIL for ~130 ms and stops every executor. Freezing them keeps
    # later collections (automatic, or after an unload) down to what is new.
    gc.freeze()
    for executor in booted.executors:
        executor.start()
    control.send(messages.encode(booted.ready))
    log.info("ready on %s with %d executor(s), pid %d", spec.device, len(booted.executors), os.getpid())
    # From now on this thread only loads and warms new versions: let the
    # executors, which serve the live one, have the CPU first.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
    _serve_control(control, booted.runner, booted.executors)
    os.write(stop_w, b"\0")
    for executor in booted.executors:
        executor.join()
    booted.release()
    control.close()
    context.term()
    log.info("stopped")
    logging.shutdown()
    # Everything this process owns is released; skip the interpreter's slow
    # teardown (of torch, in a worker), which would only delay the supervisor's stop.
    os._exit(0)


def _serve_control(control: zmq.Socket, runner: Runner, executors: Sequence[Executor]) -> None:
    """Load and unload versions, answer pings, and trim, as the supervisor asks, until it says Shutdown.

    Loading runs here, in the main thread, while the executors go on serving the
    live version; a version becomes usable only once the supervisor flips to it.
    """
    while True:
        if not control.poll(IDLE_CHECK_MS):
            runner.idle(control, executors)
            continue
        message = messages.decode(control.recv())
        if isinstance(message, messages.Shutdown):
            return
        if isinstance(message, messages.LoadVersion):
            reply: messages.VersionLoaded | messages.VersionFailed
            try:
                loaded, load_s, warm_s = runner.load_version(message)
                reply = messages.VersionLoaded(message.model, loaded, load_s, warm_s)
            # Not only Exception: the process must live on after a sys.exit() in code a model file runs.
            except BaseException as exc:  # noqa: BLE001 - a model may raise anything
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
            runner.trim(control)
