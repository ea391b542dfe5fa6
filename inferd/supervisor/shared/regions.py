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
from typing import Any, NamedTuple

from inferd.errors import InvalidRequest
from inferd.system.shm_names import ARENA_NAME, SHM_DIR

KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
MAX_REGIONS_PER_CONNECTION = 64


class Place(NamedTuple):
    """Where a request's output goes: a region, the offset in it, and the most bytes it may take there (None: an
    output that does not fit fails its request; else it comes back in the reply's frames)."""

    region: Region
    offset: int
    limit: int | None


@dataclass(eq=False)
class Region:
    """One registered region: the client's name for it, its file, and the window of it registered."""

    name: str
    key: str
    offset: int
    size: int
    fd: int
    owner: str  # the connection that registered it, as a person reads it
    clients: bool = True  # a client's, not the daemon's own (a gateway's, for its large requests)
    requests: int = 0
    closed: bool = False

    def check(self, offset: int, length: int, what: str) -> None:
        """InvalidRequest unless `length` bytes from `offset` on lie in the registered window."""
        if self.closed:
            raise InvalidRequest(f"region {self.name!r} was unregistered while the request waited")
        if offset + length > self.size:
            raise InvalidRequest(f"{what} needs bytes {offset} to {offset + length} of region {self.name!r}, "
                                 f"which is {self.size} bytes")

    def read_into(self, target: memoryview, offset: int) -> None:
        """Fill `target` with the region's bytes from `offset` on (InvalidRequest if the file is shorter now)."""
        self.check(offset, len(target), "an input")
        try:
            done = os.preadv(self.fd, [target], self.offset + offset)
        except OSError as exc:
            raise InvalidRequest(f"region {self.name!r} cannot be read: {exc.strerror}") from None
        if done != len(target):
            raise InvalidRequest(f"region {self.name!r} was truncated: {done} of the {len(target)} bytes asked for "
                                 f"at offset {offset} are there")

    def write_from(self, parts: Sequence[memoryview], offset: int) -> None:
        """Write `parts` one after the other into the region from `offset` on, never past the file's end
        (a region truncated since registration is InvalidRequest, not grown)."""
        length = sum(len(part) for part in parts)
        self.check(offset, length, "an output")
        try:
            if os.fstat(self.fd).st_size < self.offset + offset + length:
                raise InvalidRequest(f"region {self.name!r} was truncated: it no longer holds bytes {offset} to "
                                     f"{offset + length}")
            os.pwritev(self.fd, parts, self.offset + offset)
        except OSError as exc:  # /dev/shm full (a write into a hole of the file allocates), or worse
            raise InvalidRequest(f"region {self.name!r} cannot be written: {exc.strerror}") from None

    def close(self) -> None:
        """Close its file descriptor; a request that still names it is answered `invalid`."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class RegionSlice:
    """An input of a queued request that lies in a region: where, and how many bytes."""

    __slots__ = ("nbytes", "offset", "region")

    def __init__(self, region: Region, offset: int, nbytes: int) -> None:
        self.region = region
        self.offset = offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def read_into(self, target: memoryview) -> None:
        """Copy the input's bytes into `target` (InvalidRequest if the region no longer has them)."""
        self.region.read_into(target, self.offset)


def _open(key: str, offset: int, size: int, prefix: str, folder: Path) -> int:
    if not KEY.match(key) or key in (".", ".."):
        raise InvalidRequest(f"{key!r} is not a shared-memory name: letters, digits, '_', '.', '-', at most 200")
    if ARENA_NAME.match(key):
        raise InvalidRequest(f"{key!r} is one of the daemon's own arenas, not a client's region")
    if not key.startswith(prefix):
        raise InvalidRequest(f"the region's shared-memory name {key!r} does not start with {prefix!r} "
                             "(server.client_shm_prefix)")
    try:
        fd = os.open(folder / key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
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
    """Every connection's registered regions, by connection and the client's name for each.

    An owner is whatever identifies a client connection (hashable); each is also filed under its
    transport connection (`link`), so that all of a connection's regions go when it drops.
    """

    def __init__(self, prefix: str, folder: Path = SHM_DIR) -> None:
        self.prefix = prefix
        self._folder = folder
        self._by_owner: dict[Hashable, dict[str, Region]] = {}
        self._by_link: dict[Hashable, set[Hashable]] = {}
        self._link_of: dict[Hashable, Hashable] = {}
        self.held = 0  # clients' regions open, each holding a descriptor

    def register(self, owner: Hashable, name: str, key: str, offset: int, size: int, *,
                 describe: str = "", link: Hashable = None, prefix: str | None = None) -> Region:
        """Open shared memory `key` (a POSIX name: a leading '/' is allowed) and register `size` bytes of
        it from `offset` on as `owner`'s region `name`; InvalidRequest with a sentence if any rule forbids.
        `prefix`: what `key` must start with, where not a client's (server.client_shm_prefix)."""
        owned = self._by_owner.get(owner, {})
        if name in owned:
            raise InvalidRequest(f"region {name!r} is already registered on this connection; unregister it first")
        if len(owned) >= MAX_REGIONS_PER_CONNECTION:
            raise InvalidRequest(f"this connection has {MAX_REGIONS_PER_CONNECTION} regions registered, "
                                 "the most one may have")
        key = key.removeprefix("/")
        fd = _open(key, offset, size, self.prefix if prefix is None else prefix, self._folder)
        region = Region(name, key, offset, size, fd, describe or str(owner), clients=prefix is None)
        self.held += region.clients
        self._by_owner.setdefault(owner, {})[name] = region
        self._by_link.setdefault(link, set()).add(owner)
        self._link_of[owner] = link
        return region

    def get(self, owner: Hashable, name: str) -> Region:
        """`owner`'s region `name`: InvalidRequest if this connection registered none by that name."""
        region = self._by_owner.get(owner, {}).get(name)
        if region is None:
            raise InvalidRequest(f"no region {name!r} is registered on this connection")
        return region

    def of(self, owner: Hashable, name: str | None = None) -> list[Region]:
        """`owner`'s region `name` (InvalidRequest if it has none by that name), or all of its regions."""
        if name is not None:
            return [self.get(owner, name)]
        return list(self._by_owner.get(owner, {}).values())

    def unregister(self, owner: Hashable, name: str | None = None) -> int:
        """Close `owner`'s region `name`, or all of them: how many were closed."""
        owned = self._by_owner.get(owner, {})
        names = list(owned) if name is None else [name] if name in owned else []
        for each in names:
            region = owned.pop(each)
            region.close()
            self.held -= region.clients
        if not owned and self._by_owner.pop(owner, None) is not None:
            # A gateway's link carries one owner per client connection: forget those with no regions left.
            link = self._link_of.pop(owner)
            linked = self._by_link[link]
            linked.discard(owner)
            if not linked:
                del self._by_link[link]
        return len(names)

    def drop_link(self, link: Hashable) -> int:
        """A transport connection went away: close every region registered over it; how many were."""
        return sum(self.unregister(owner) for owner in list(self._by_link.get(link, ())))

    def close(self) -> None:
        """At stop: close every region of every connection."""
        for owner in list(self._by_owner):
            self.unregister(owner)

    def status(self) -> list[dict[str, Any]]:
        """Each registered region: name, shared memory, window, owner and requests served."""
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.size, "owner": r.owner,
                 "requests": r.requests}
                for owned in self._by_owner.values() for r in owned.values()]
