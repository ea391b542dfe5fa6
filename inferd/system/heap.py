"""Giving the memory a process has freed back to the system.

glibc's malloc keeps what a process frees for its next allocations, and after a
large block is freed it raises its mmap threshold, so that later large blocks
come from the heap as well, where freeing them returns nothing. The supervisor
allocates each request's buffers as ZeroMQ receives it and frees them once the
batch is stacked or the request refused: after a flood of large requests it
would keep the flood's size for as long as it runs. `give_back` hands the free
parts of every malloc arena back (malloc_trim); with nothing to hand back it
costs a couple of microseconds, so the supervisor calls it on every tick.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc_name = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_libc_name), "malloc_trim", None) if _libc_name else None


def give_back() -> None:
    """Return the heap's free memory to the system, where the C library can (glibc); else nothing."""
    if _malloc_trim is not None:
        _malloc_trim(0)
