"""Shared-memory arenas: one per worker, cut into fixed slots, one batch per slot.

Only the supervisor creates and unlinks an arena; a worker attaches to it by
name. Segments live in /dev/shm as plain files opened directly (what shm_open
does on Linux), so no resource tracker is involved and cleanup never depends on
a finalizer: the supervisor unlinks on every exit it survives, and the next
start sweeps the arenas of supervisors that are gone.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from pathlib import Path

import psutil

log = logging.getLogger("inferd.arena")

SHM_DIR = Path("/dev/shm")
PREFIX = "inferd-"
ALIGN = 64
_NAME = re.compile(rf"^{PREFIX}(\d+)-\w+$")


def align_up(offset: int, alignment: int = ALIGN) -> int:
    """`offset` rounded up to a multiple of `alignment`."""
    return (offset + alignment - 1) // alignment * alignment


def arena_name(supervisor_pid: int, worker: int) -> str:
    """The segment name of a worker's arena: `inferd-<supervisor pid>-<worker>`."""
    return f"{PREFIX}{supervisor_pid}-w{worker}"


class ArenaError(Exception):
    """An arena cannot be created or attached."""


class Arena:
    """A named shared-memory segment mapped into this process."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = len(mapping)
        self.owner = owner
        self._mapping: mmap.mmap | None = mapping
        self.buf = memoryview(mapping)

    @property
    def path(self) -> Path:
        """The segment's file under /dev/shm."""
        return SHM_DIR / self.name

    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        """Create a new segment of `size` bytes, owner-only, after checking /dev/shm has room."""
        stat = os.statvfs(SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
        if free < size:
            raise ArenaError(
                f"{SHM_DIR} has {free >> 20} MiB free but the arena {name} needs {size >> 20} MiB; "
                "lower workers.shm_mb or make /dev/shm larger"
            )
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, owner=True)

    @classmethod
    def attach(cls, name: str) -> Arena:
        """Map an existing segment; the attacher never unlinks it."""
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(f"the arena {name} does not exist") from None
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mapping, owner=False)

    def address(self) -> int:
        """The mapping's address in this process (for cudaHostRegister)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mapping))

    def close(self) -> None:
        """Unmap; idempotent. A view still exported keeps the mapping until process exit."""
        if self._mapping is None:
            return
        self.buf.release()
        try:
            self._mapping.close()
        except BufferError:
            log.debug("arena %s still has views; it is unmapped at exit", self.name)
        self._mapping = None

    def unlink(self) -> None:
        """Remove the segment's name (owner only); idempotent."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def owner_alive(pid: int, created: float) -> bool:
    """True when `pid` is an inferd process that already ran when the segment was made."""
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    # A pid reused by a process that started after the segment is not its owner.
    return started <= created + 1.0 and "inferd" in cmdline


def sweep_stale() -> list[str]:
    """Unlink arenas whose supervisor no longer runs; return their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if not match:
            continue
        try:
            created = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if owner_alive(int(match.group(1)), created):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except PermissionError:
            log.warning("stale arena %s belongs to another user; cannot remove it", path)
            continue
        removed.append(path.name)
        log.info("removed stale arena %s", path.name)
    return removed


class SlotPool:
    """Equal, page-aligned slots of one arena, handed out and taken back by index."""

    def __init__(self, arena_size: int, count: int) -> None:
        self.slot_size = arena_size // count // mmap.PAGESIZE * mmap.PAGESIZE
        if self.slot_size == 0:
            raise ArenaError(f"an arena of {arena_size} bytes cannot hold {count} slots")
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    def acquire(self) -> int | None:
        """A free slot's index, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        """Give a slot back; releasing a slot twice is a bug and raises."""
        if slot in self._free or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        """Byte offset of a slot in its arena."""
        return slot * self.slot_size

    @property
    def free(self) -> int:
        """How many slots are free."""
        return len(self._free)
