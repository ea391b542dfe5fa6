"""What every process the supervisor spawns (workers, gateways) does first."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

import setproctitle

from inferd.logs import setup_logging

log = logging.getLogger("inferd.child")


def begin_child(title: str, component: str, log_level: str, parent_gone_code: int) -> None:
    """Name the process `title` in ps, log as `component`, leave SIGINT to the supervisor, and exit
    with `parent_gone_code` the moment the supervisor is gone, so no orphan holds a port or a device."""
    setproctitle.setproctitle(title)
    setup_logging(component, log_level)
    # The supervisor decides when its children stop; a Ctrl-C in the terminal reaches the whole
    # process group, and must not cut short the work the drain still needs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("the supervisor is gone; exiting")
        os._exit(parent_gone_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
