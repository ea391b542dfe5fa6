"""A thread of a child process stopped while the process's other threads run on: the supervisor's loop
held still, as on a machine too busy to run it, while ZeroMQ's I/O thread keeps receiving.

ptrace stops one thread (PTRACE_INTERRUPT on a seized thread), where a signal would stop them all. The
tracer is the calling thread: it alone may stop and let go. Should the test die, the kernel lets go.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import pytest

PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH = 0x4206, 0x4207, 17
WALL = 0x40000000  # waitpid's __WALL: a thread of another process is waited for as a child is

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, tid: int) -> None:
    if _libc.ptrace(request, tid, None, None) == -1:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@contextlib.contextmanager
def stopped(tid: int) -> Iterator[None]:
    """Thread `tid` (of a child process of this one) stopped for the block; the test is skipped where this
    system does not let it trace its children."""
    try:
        _ptrace(PTRACE_SEIZE, tid)
    except PermissionError as exc:
        pytest.skip(f"this system does not let a test stop a thread of its child with ptrace ({exc})")
    try:
        _ptrace(PTRACE_INTERRUPT, tid)
        os.waitpid(tid, WALL)
        yield
    finally:
        _ptrace(PTRACE_DETACH, tid)
