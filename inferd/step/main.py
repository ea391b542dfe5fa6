"""A step: one process of a Python model's pool (models.NAME.processes), `inferd: step NAME.K`.

The supervisor starts it as `python -m inferd.step` under the model's interpreter (models.NAME.python, else its
own), its spec on standard input. Its life is every compute process's (inferd.compute.process: hello, boot,
ready, control messages, stop); what is a step's own is here: it attaches its arena, imports the model's
model.py and makes its Model (runner), and runs one executor, on the CPU: a step's CPU work scales with its
model's processes, not with threads. It exits on its own as soon as its standard input ends, which is when
the supervisor is gone.
"""

from __future__ import annotations

import os

import msgspec
import zmq

from inferd.compute.executor import Overlap
from inferd.compute.process import Booted, ProcessSpec, read_spec, run_process
from inferd.config import loading
from inferd.config.schema import Config
from inferd.ipc import messages
from inferd.ipc.arena import Arena
from inferd.step.executor import StepExecutor
from inferd.step.runner import PythonRunner

STDIN = 0


def main() -> None:
    """Entry point of a step process (`python -m inferd.step`)."""
    spec = msgspec.msgpack.decode(read_spec(STDIN), type=ProcessSpec)
    run_process(spec, loading.decode(spec.config), _boot, parent_fd=STDIN)


def _boot(spec: ProcessSpec, config: Config, context: zmq.Context, stop_fd: int) -> Booted:
    """Attach the arena, load the model's live version, make the executor (not yet started)."""
    arena = Arena.attach(spec.arena)
    runner = PythonRunner()
    executor = StepExecutor(0, context, spec.backend, messages.Hello(spec.worker, spec.generation, 0), arena, runner,
                            stop_fd, Overlap())
    try:
        loaded = {name: runner.load(name, config.models[name], version)[0] for name, version in spec.versions.items()}
    except BaseException:
        executor.socket.close()  # never started: its socket would keep the context from closing
        raise

    def release() -> None:
        runner.close()
        arena.close()

    return Booted([executor], runner, messages.Ready(pid=os.getpid(), device=spec.device, models=loaded), release)
