"""A gateway's listener out of descriptors (or socket memory): asyncio says so for every connection it
fails to accept, again each second while it lasts, dozens of lines a second in the journal. This says it
once a minute, with what ran out and what to raise; the client waits in the listen queue meanwhile and is
taken when a connection closes."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

from inferd.system import open_files

log = logging.getLogger("inferd.gateway")

ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message, with the OSError
SAY_EVERY_S = 60.0


class AcceptFailures:
    """The loop's exception handler: accept() failures counted and said once a minute, the rest as asyncio
    would."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.failed = 0
        self._next = 0.0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle `loop`'s exceptions from now on."""
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") != ACCEPT_FAILED or not isinstance(exc, OSError):
            loop.default_exception_handler(context)
            return
        self.failed += 1
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + SAY_EVERY_S
        name = errno.errorcode.get(exc.errno or 0, "")
        why = open_files.advice(name) if name in ("EMFILE", "ENFILE") else \
            f"the system has no memory left for another socket ({exc.strerror})"
        log.warning("a client connecting to %s cannot be accepted and waits until a connection closes: %s. "
                    "Said once a minute while it lasts (%d failed accepts so far)", self.address, why, self.failed)
