"""What every process the supervisor starts (workers, steps, gateways) does first."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

import setproctitle

from inferd.system.logs import setup_logging

log = logging.getLogger("inferd.system.child")

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# In the workers' fork server and what it forks, the server's pid (inferd.worker.preload sets it).
fork_server: int | None = None


def begin_child(title: str, component: str, log_level: str, parent_gone_code: int,
                parent_fd: int | None = None) -> None:
    """Name the process `title` in ps, log as `component`, leave SIGINT to the supervisor, and exit
    with `parent_gone_code` the moment the supervisor is gone, so no orphan holds a port or a device: when
    `parent_fd` (the read end of a pipe only the supervisor writes to) comes to its end, or else when
    multiprocessing's sentinel of the parent says so."""
    if fork_server is not None:
        _die_with_fork_server(parent_gone_code)
    setproctitle.setproctitle(title)
    setup_logging(component, log_level)
    # The supervisor decides when its children stop; a Ctrl-C in the terminal reaches the whole
    # process group, and must not cut short the work the drain still needs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    sentinel = parent_fd if parent_fd is not None else parent.sentinel if parent is not None else None
    if sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        log.error("the supervisor is gone; exiting")
        if os.getpgrp() == os.getpid():
            # A step leads a group of its own (supervisor.processes.children), which its model's helpers
            # joined; the supervisor that would have killed it as it reaped the step is gone.
            logging.shutdown()
            os.killpg(0, signal.SIGKILL)
        os._exit(parent_gone_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _die_with_fork_server(parent_gone_code: int) -> None:
    """Have the kernel kill this process when the fork server that forked it exits. The supervisor learns of a
    worker's exit from the fork server, so it would take the workers of one that died for dead, and start others
    beside them."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != fork_server:  # it exited before the line above
        os._exit(parent_gone_code)
