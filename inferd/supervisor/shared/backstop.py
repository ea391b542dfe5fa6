"""The exception backstop of every socket handler: what one message raises is logged, and the loop serves on."""

from __future__ import annotations

import logging

log = logging.getLogger("inferd.backstop")


def failure(what: str) -> str:
    """Log the exception being handled, with its traceback, as a failure on `what` (say "a request");
    return the sentence to answer it with, where an answer can go."""
    log.exception("handling %s raised; the daemon serves on", what)
    return f"the daemon failed on {what} (a bug; its traceback is in the daemon's log)"
