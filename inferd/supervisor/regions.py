"""Clients' shared-memory regions as the supervisor holds them: registered per connection, and read
and written through their file descriptor, never mapped.

A region is a file in /dev/shm that a local client created and filled. The supervisor opens it once,
at registration, without following symlinks, and then moves a request's input bytes from it straight
into the arena slot (os.preadv: the one copy on the way to the device) and its outputs back (os.pwritev).
Because the region is never mapped, a client that truncates it under the daemon causes a short read,
answered with a sentence, not a SIGBUS that would kill the supervisor. A region belongs to the
connection that registered it: no other connection can name it, and it is closed when that connection
unregisters it, goes away, or the daemon stops.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.errors import InvalidRequest
from inferd.ipc.arena import SHM_DIR

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
ARENA = re.compile(r"^inferd-\d+-")  # the daemon's own arenas (ipc.arena.arena_name)
MAX_REGIONS_PER_CONNECTION = 64


@dataclass
class Region:
    """One registered region: the client's name for it, its file, and the window of it registered."""

    name: str
    key: str
    offset: int
    size: int
    fd: int
    requests: int = 0

    def _check_window(self, offset: int, length: int, what: str) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidRequest(f"{what} asks for bytes {offset} to {offset + length} of region {self.name!r}, "
                                 f"which is {self.size} bytes")

    def read_into(self, target: memoryview, offset: int) -> None:
        """Fill `target` with the region's bytes from `offset` on (InvalidRequest if the file is shorter now)."""
        self._check_window(offset, len(target), "an input")
        done = os.preadv(self.fd, [target], self.offset + offset)
        if done != len(target):
            raise InvalidRequest(f"region {self.name!r} was truncated: {done} of the {len(target)} bytes asked for "
                                 f"at offset {offset} are there")
        self.requests += 1

    def write_from(self, parts: Sequence[memoryview], offset: int) -> None:
        """Write `parts` one after the other into the region from `offset` on, never past the file's end
        (a region truncated since registration is InvalidRequest, not grown)."""
        length = sum(len(part) for part in parts)
        self._check_window(offset, length, "an output")
        if os.fstat(self.fd).st_size < self.offset + offset + length:
            raise InvalidRequest(f"region {self.name!r} was truncated: it no longer holds bytes {offset} to "
                                 f"{offset + length}")
        os.pwritev(self.fd, parts, self.offset + offset)

    def close(self) -> None:
        """Close its file descriptor."""
        os.close(self.fd)


def _open(key: str, offset: int, size: int, prefix: str, folder: Path) -> int:
    if not NAME.match(key) or key in (".", ".."):
        raise InvalidRequest(f"{key!r} is not a shared-memory name: letters, digits, '_', '.', '-', at most 200")
    if ARENA.match(key):
        raise InvalidRequest(f"{key!r} is one of the daemon's own arenas, not a client's region")
    if not key.startswith(prefix):
        raise InvalidRequest(f"the region's shared-memory name {key!r} does not start with {prefix!r} "
                             "(server.client_shm_prefix)")
    if offset < 0 or size <= 0:
        raise InvalidRequest(f"a region needs offset >= 0 and byte_size > 0, got {offset} and {size}")
    try:
        fd = os.open(folder / key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidRequest(f"no shared memory named {key!r} in {folder}") from None
    except OSError as exc:
        reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise InvalidRequest(f"cannot open shared memory {key!r}: {reason}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"shared memory {key!r} is not a regular file"
    elif info.st_size < offset + size:
        problem = (f"shared memory {key!r} is {info.st_size} bytes, too small for byte_size {size} at "
                   f"offset {offset}")
    if problem:
        os.close(fd)
        raise InvalidRequest(problem)
    return fd


class Regions:
    """Every connection's registered regions, by connection and the client's name for each."""

    def __init__(self, prefix: str, folder: Path = SHM_DIR) -> None:
        self.prefix = prefix
        self._folder = folder
        self._by_owner: dict[Hashable, dict[str, Region]] = {}

    def register(self, owner: Hashable, name: str, key: str, offset: int, size: int) -> Region:
        """Open shared memory `key` (a POSIX name: a leading '/' is allowed) and register `size` bytes of
        it from `offset` on as `owner`'s region `name`; InvalidRequest with a sentence if any rule forbids."""
        if not NAME.match(name):
            raise InvalidRequest(f"{name!r} is not a region name: letters, digits, '_', '.', '-', at most 200")
        owned = self._by_owner.setdefault(owner, {})
        if name in owned:
            raise InvalidRequest(f"region {name!r} is already registered on this connection; unregister it first")
        if len(owned) >= MAX_REGIONS_PER_CONNECTION:
            raise InvalidRequest(f"this connection has {MAX_REGIONS_PER_CONNECTION} regions registered, "
                                 "the most one may have")
        fd = _open(key.removeprefix("/"), offset, size, self.prefix, self._folder)
        region = owned[name] = Region(name, key.removeprefix("/"), offset, size, fd)
        return region

    def get(self, owner: Hashable, name: str) -> Region:
        """`owner`'s region `name`: InvalidRequest if this connection registered none by that name."""
        region = self._by_owner.get(owner, {}).get(name)
        if region is None:
            raise InvalidRequest(f"no region {name!r} is registered on this connection")
        return region

    def unregister(self, owner: Hashable, name: str | None = None) -> int:
        """Close `owner`'s region `name`, or all of them: how many were closed."""
        owned = self._by_owner.get(owner, {})
        names = list(owned) if name is None else [name] if name in owned else []
        for each in names:
            owned.pop(each).close()
        if not owned:
            self._by_owner.pop(owner, None)
        return len(names)

    def close(self) -> None:
        """At stop: close every region of every connection."""
        for owner in list(self._by_owner):
            self.unregister(owner)

    def status(self) -> list[dict[str, Any]]:
        """Each registered region: name, shared memory, window, owner and requests served."""
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.size, "owner": str(owner),
                 "requests": r.requests}
                for owner, owned in self._by_owner.items() for r in owned.values()]
