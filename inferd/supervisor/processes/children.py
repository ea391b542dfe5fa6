"""The supervisor's child processes (workers, steps, gateways): how each is started, restarted, given up and
stopped.

A child that dies unexpectedly is started again at once the first time, then
after a doubling backoff; one that dies more than `workers.max_restarts` times
within CRASH_WINDOW_S is given up, since a new process would most likely die the
same way and a crash loop only burns the cores the others serve on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import select
import signal
import subprocess
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import ClassVar

from inferd.compute.process import handed_over

CRASH_WINDOW_S = 60.0  # deaths counted against workers.max_restarts within this window
MAX_BACKOFF_S = 30.0
STOP_TIMEOUT_S = 10.0  # how long a child told to stop may take before it is killed
KILLED_JOIN_S = 5.0  # how long a killed child may take to be reaped

# A fresh interpreter for each gateway: a forked supervisor would hand it its sockets and threads.
SPAWNED = multiprocessing.get_context("spawn")
# Each worker forked from a fork server: a fresh interpreter of its own (none of the supervisor's sockets or
# threads either) that has imported torch once, so that neither a worker started after a crash nor the many
# workers of a machine of many devices wait for an import of their own (inferd.worker.preload says what it
# imports and why forking it is safe).
FORKED = multiprocessing.get_context("forkserver")
WORKER_PRELOAD = "inferd.worker.preload"


def leave_out_current_folder() -> None:
    """Have the interpreters started for children from now on keep the current folder off their sys.path.

    multiprocessing starts each (`python -c ...`, the fork server too) as Python starts any `-c`: with the
    current folder first on sys.path. Run from the folder above a clone named `inferd`, the fork server then
    imports the clone's folder as the package, and every worker dies on its first import. PYTHONSAFEPATH
    (Python's -P) drops only that implicit entry: a PYTHONPATH still counts."""
    if not os.environ.get("PYTHONSAFEPATH"):
        os.environ["PYTHONSAFEPATH"] = "1"


def fork_server_folder() -> Path:
    """The private folder the fork server's socket goes in: made now, removed when this process exits (or by the
    reaper, if it is killed)."""
    return Path(multiprocessing.util.get_temp_dir())


def start_fork_server() -> None:
    """Start the workers' fork server now, so that its import of torch runs while the supervisor starts the rest;
    the first worker's start waits for what is left of it."""
    leave_out_current_folder()
    FORKED.set_forkserver_preload([WORKER_PRELOAD])
    multiprocessing.forkserver.ensure_running()


def backoff(crashes: int) -> float:
    """Seconds before the next process after the `crashes`-th death within the window: none after the first,
    then doubling from half a second, at most MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, 0.5 * 2 ** (crashes - 2)) if crashes > 1 else 0.0


class CommandProcess:
    """A child started from a command line, not by multiprocessing: a Python model's step, under the interpreter
    its config names. multiprocessing's spawn would hand that interpreter the supervisor's sys.path and have it
    run the supervisor's main module, so a foreign interpreter would import the daemon's packages (torch among
    them) rather than its own.

    Its spec reaches it on its standard input, a pipe the supervisor then keeps open for the child's life and
    never writes to again: the pipe's end tells the child its supervisor is gone. It offers what the supervisor
    reads of a multiprocessing process: `pid`, `sentinel` (a pidfd, readable once it exits), `exitcode`,
    `join`.

    It leads a process group of its own, which what its model starts (a helper process) joins: once it has
    exited, the group is killed as it is reaped, so nothing it started outlives it, however it ended. (A
    Ctrl-C, which reaches the terminal's process group, then reaches neither: the supervisor stops them.)"""

    def __init__(self, argv: list[str], spec: bytes, env: dict[str, str]) -> None:
        self._popen = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, process_group=0)
        self.pid: int | None = self._popen.pid
        self.sentinel = os.pidfd_open(self._popen.pid)
        assert self._popen.stdin is not None
        self._popen.stdin.write(handed_over(spec))
        self._popen.stdin.flush()

    @property
    def exitcode(self) -> int | None:
        """Its exit status once `join` has seen it exit (negative: the signal that killed it), else None: never
        reaped here, where its process group would be left behind (join)."""
        return self._popen.returncode

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` for it to exit; once it has, kill what is left of its process group, and close
        what the supervisor held of it."""
        if self.sentinel != -1 and self._popen.returncode is None:
            if not select.select([self.sentinel], [], [], timeout)[0]:
                return
            # Before it is reaped: till then its pid, the group's id, cannot be another process's.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGKILL)
        self._popen.wait()
        if self.sentinel != -1:
            os.close(self.sentinel)
            self.sentinel = -1
            assert self._popen.stdin is not None
            self._popen.stdin.close()


@dataclass(eq=False, kw_only=True)
class ChildProcess:
    """One child the supervisor keeps running: the process serving now, its restarts and its recent deaths."""

    starter: ClassVar[SpawnContext | ForkServerContext] = SPAWNED  # how its processes are started
    process: BaseProcess | CommandProcess | None = None
    restarts: int = 0
    respawn_at: float = 0.0  # when the next process may start (monotonic)
    deaths: deque[float] = field(default_factory=deque)  # times of its unexpected exits within the window

    @property
    def pid(self) -> int | None:
        """The pid of the current process, if one runs."""
        return self.process.pid if self.process is not None else None

    def spawn(self, target: Callable[[bytes], None], spec: bytes, name: str) -> int:
        """Start a process that runs `target(spec)`; its pid."""
        leave_out_current_folder()  # the fork server too, started again here if it died
        process = self.starter.Process(target=target, args=(spec,), name=name)
        process.start()
        self.process = process
        assert process.pid is not None
        return process.pid

    def start_command(self, argv: list[str], spec: bytes, env: dict[str, str]) -> int:
        """Start a process from the command line `argv`, which reads `spec` from its standard input; its pid."""
        leave_out_current_folder()
        process = CommandProcess(argv, spec, {**os.environ, "PYTHONSAFEPATH": "1", **env})
        self.process = process
        assert process.pid is not None
        return process.pid

    def exited(self) -> int | None:
        """Collect the process, whose sentinel said it exited; its exit code."""
        assert self.process is not None
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        self.process = None
        return code

    def crashed(self, now: float, max_restarts: int) -> float | None:
        """Count an unexpected exit at `now` and schedule the next process: the seconds until it may start,
        or None when this is more than `max_restarts` deaths within CRASH_WINDOW_S (it is given up)."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > CRASH_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > max_restarts:
            return None
        delay = backoff(len(self.deaths))
        self.restarts += 1
        self.respawn_at = now + delay
        return delay

    def signal(self, signum: int) -> None:
        """Send `signum` to the process, if one runs; one that has just exited is no error."""
        if self.process is not None and self.process.pid is not None:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the process; its sentinel then reports the death."""
        self.signal(signal.SIGKILL)

    def wait_or_kill(self, timeout: float) -> bool:
        """At exit: wait up to `timeout` for the process (told to stop) to exit, then kill it; True when it had
        to be killed."""
        if self.process is None:
            return False
        self.process.join(max(0.0, timeout))
        killed = self.process.exitcode is None
        if killed:
            self.kill()
            self.process.join(KILLED_JOIN_S)
        self.process = None
        return killed
