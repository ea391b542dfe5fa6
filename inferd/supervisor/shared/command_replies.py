"""How a long command answers whoever waits for it: progress lines, then one success or one failure.

The control server answers an `inferctl` waiting on its socket (control_server.ControlReply); a reload that a
config change started answers the log (LoggedReply); one step of a longer command hands its end to the next
(Then). The reload and trial managers answer through a Reply, whoever it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("inferd.control")


class Reply(Protocol):
    """Whoever waits for a long command: progress lines, then one success or one failure."""

    def progress(self, text: str, wait_s: float | None = None) -> None:
        """A step towards the end; `wait_s`: the end comes within this many seconds from now."""

    def finish(self, result: Any) -> None:
        """The command succeeded with `result`."""

    def fail(self, error: str) -> None:
        """The command failed; `error` is one sentence."""


class Then:
    """A step of a longer command: its progress and failure go to `reply`, and its success, instead of
    answering, runs `then` (the next step, which answers `reply` in the end)."""

    def __init__(self, reply: Reply, then: Callable[[], None]) -> None:
        self.reply = reply
        self.then = then

    def progress(self, text: str, wait_s: float | None = None) -> None:
        """Pass the step's progress on."""
        self.reply.progress(text, wait_s)

    def finish(self, result: Any) -> None:
        """The step succeeded: go on with the next."""
        self.then()

    def fail(self, error: str) -> None:
        """The step failed, and so does the command."""
        self.reply.fail(error)


class LoggedReply:
    """A reply nobody waits for (a reload a config change started): its lines go to the log."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = False

    def progress(self, text: str, wait_s: float | None = None) -> None:
        """Log a step."""
        log.info("%s: %s", self.what, text)

    def finish(self, result: Any) -> None:
        """Log the success."""
        self.done = True
        log.info("%s: done: %s", self.what, result)

    def fail(self, error: str) -> None:
        """Log the failure."""
        self.done = True
        log.error("%s: %s", self.what, error)
