"""A client's side of shared-memory regions: the file in /dev/shm, its mapping, and numpy views over it.

A region is created (or opened) and mapped here, then registered with the daemon by `Client`. The
caller fills inputs in place through `array` views and reads outputs the daemon wrote the same way;
an array that lies in a registered region travels as a reference to it instead of as bytes.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from inferd import protocol
from inferd.system.shm_names import CLIENT_PREFIX, SHM_DIR


class SharedMemoryRegion:
    """`byte_size` bytes from `offset` on of the shared memory `key`, mapped into this process, known to
    the daemon as `name`. `create`: make the file (mode 0600), and unlink it again on `close`."""

    def __init__(self, name: str, key: str, byte_size: int, offset: int = 0, create: bool = False) -> None:
        self.name = name
        self.key = key.removeprefix("/")
        self.byte_size = byte_size
        self.offset = offset
        self.created = create
        path = SHM_DIR / self.key
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, offset + byte_size)
            self._mapping = mmap.mmap(fd, offset + byte_size)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps the memory
        self._bytes: np.ndarray | None = np.frombuffer(self._mapping, dtype=np.uint8)[offset:]
        self._base: int = self._bytes.__array_interface__["data"][0]

    @classmethod
    def create(cls, byte_size: int, name: str | None = None, prefix: str = CLIENT_PREFIX) -> SharedMemoryRegion:
        """A new region of `byte_size` bytes under a fresh shared-memory name that starts with `prefix`."""
        unique = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return cls(name or f"region-{unique}", f"{prefix}{unique}", byte_size, create=True)

    def array(self, dtype: str | np.dtype, shape: tuple[int, ...] | list[int], offset: int = 0) -> np.ndarray:
        """A numpy view of the region from `offset` on (bytes from the registered window's start)."""
        if self._bytes is None:
            raise ValueError(f"region {self.name!r} is closed")
        wanted = np.dtype(protocol.DTYPES.get(str(dtype), dtype))
        count = int(np.prod(shape)) if len(shape) else 1
        if offset < 0 or offset + count * wanted.itemsize > self.byte_size:
            raise ValueError(f"{count * wanted.itemsize} bytes at offset {offset} do not fit region {self.name!r} "
                             f"of {self.byte_size} bytes")
        return self._bytes[offset: offset + count * wanted.itemsize].view(wanted).reshape(shape)

    def put_bytes(self, values: np.ndarray, offset: int = 0) -> protocol.TensorMeta:
        """Write byte strings (an array of bytes or str, of its shape) into the region from `offset` on, in the
        BYTES layout; the description of the input they make, to pass in place of the array."""
        array = protocol.wire_array(np.asarray(values, dtype=object))
        data = protocol.pack_bytes(array.flat)
        self.array("uint8", (len(data),), offset)[:] = np.frombuffer(data, dtype=np.uint8)
        return protocol.TensorMeta(protocol.BYTES, tuple(array.shape), self.name, offset, len(data))

    def bytes_at(self, shape: tuple[int, ...], offset: int, byte_size: int) -> np.ndarray:
        """The byte strings of a BYTES tensor of `shape` the daemon wrote at `offset` (`byte_size` bytes)."""
        return protocol.bytes_array(self.array("uint8", (byte_size,), offset).data, shape)

    def locate(self, array: np.ndarray) -> int | None:
        """The byte offset in this region where `array`'s contiguous bytes lie, or None if they lie elsewhere."""
        if self._bytes is None or not array.flags.c_contiguous or array.nbytes == 0:
            return None
        start = array.__array_interface__["data"][0] - self._base
        return start if start >= 0 and start + array.nbytes <= self.byte_size else None

    def describe(self, array: np.ndarray) -> protocol.TensorMeta | None:
        """A wire-ready `array` (protocol.wire_array) as an input in this region, or None if it is not in it."""
        offset = self.locate(array)
        return None if offset is None else protocol.TensorMeta(array.dtype.name, tuple(array.shape), self.name, offset)

    def close(self) -> None:
        """Unmap (once no view of it is left) and, if this region created its file, unlink it."""
        if self.created:
            (SHM_DIR / self.key).unlink(missing_ok=True)
            self.created = False
        if self._bytes is None:
            return
        self._bytes = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # the caller still holds views: the mapping goes when they do
