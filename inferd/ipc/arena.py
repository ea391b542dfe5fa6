"""Shared-memory arenas: one per worker, cut into slots (ipc/slots.py), one batch per slot.

Only the supervisor creates and unlinks an arena; a worker attaches to it by
name. Segments live in /dev/shm as plain files opened directly (what shm_open
does on Linux), so no resource tracker is involved and cleanup never depends on
a finalizer: the supervisor unlinks on every exit it survives, its reaper
(supervisor/processes/reaper.py) on every exit it does not, and a start sweeps whatever
a supervisor that is gone still left.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
from pathlib import Path

from inferd.system.shm_names import ARENA_NAME, ARENA_PREFIX, SHM_DIR

log = logging.getLogger("inferd.arena")



def new_instance() -> str:
    """A name for this daemon's run: its pid (for the stale sweep) and a random part, so that
    daemons whose pids collide (containers sharing /dev/shm) never share a name."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def arena_name(instance: str, worker: int) -> str:
    """The segment name of a worker's arena: `inferd-<supervisor pid>-<random>-w<worker>`."""
    return f"{ARENA_PREFIX}{instance}-w{worker}"


def arena_names(instance: str) -> str:
    """A glob of the segment names of every arena of supervisor `instance`, those made since too."""
    return f"{ARENA_PREFIX}{instance}-w*"


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
        assert self._mapping is not None, "the arena is closed"
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
    import psutil  # the supervisor's: a step's interpreter (inferd[step]) need not have it

    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    # A pid reused by a process that started after the segment is not its owner.
    return started <= created + 1.0 and "inferd" in cmdline


def sweep_stale(folder: Path = SHM_DIR) -> list[str]:
    """Unlink the `inferd-<pid>-...` files in `folder` (arenas in /dev/shm, sockets in a
    runtime folder) whose supervisor no longer runs; return their names."""
    removed = []
    for path in folder.glob(f"{ARENA_PREFIX}*"):
        match = ARENA_NAME.match(path.name)
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
            log.warning("%s, left by a supervisor that is gone, belongs to another user; cannot remove it", path)
            continue
        removed.append(path.name)
    return removed
