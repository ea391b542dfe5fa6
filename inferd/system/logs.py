"""Logging: one line per event, to stderr, where journald picks it up."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(component: str, level: int | str = logging.INFO) -> None:
    """Send this process's logs to stderr as one line per event, tagged with `component` and pid.

    Under systemd (JOURNAL_STREAM is set) the timestamp is left to journald.
    """
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s.%(msecs)03d "
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"{stamp}{component}[%(process)d] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


def set_level(level: int | str) -> None:
    """Set this process's log level; INFERD_LOG_LEVEL, when set, wins."""
    chosen = os.environ.get("INFERD_LOG_LEVEL", level)
    logging.getLogger().setLevel(chosen.upper() if isinstance(chosen, str) else chosen)
