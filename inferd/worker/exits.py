"""How a worker process ends, as its exit status, and what the supervisor makes of each."""

from __future__ import annotations

import signal
from enum import IntEnum


class WorkerExit(IntEnum):
    """Exit statuses a worker chooses itself."""

    STOPPED = 0  # told to stop, and did
    BOOT_ERROR = 3  # could not load or warm a live version: a restart would fail the same way
    PARENT_GONE = 4  # the supervisor died; nobody reads this one, it is for a person reading `ps`
    CUDA_ERROR = 5  # a sticky CUDA error poisoned the device context: only a new process can serve


def describe_exit(code: int | None) -> str:
    """The reason a worker exited with `code` (negative: killed by that signal), in words."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        reason = f"killed by signal {-code} ({name})"
        return reason + " (perhaps out of memory?)" if code == -signal.SIGKILL else reason
    try:
        known = WorkerExit(code)
    except ValueError:
        return f"exit code {code}"
    return {
        WorkerExit.STOPPED: "exit code 0",
        WorkerExit.BOOT_ERROR: "exit code 3: it could not load its models",
        WorkerExit.PARENT_GONE: "exit code 4: its supervisor was gone",
        WorkerExit.CUDA_ERROR: "exit code 5: a CUDA error made its device context unusable",
    }[known]
