"""A gateway's own shared-memory region: the way a large request's tensors go to the supervisor and its
answer's come back, instead of in the frames of their messages.

Through the ipc:// socket a tensor's bytes are copied into the kernel by one process and out of it by the
other; through the region the gateway copies a request's inputs in once, the supervisor reads them straight
into the batch's slot and writes the outputs back there (as it does a local client's region), and the gateway
answers its client from the region. An output goes there where the model fixes its size, with that size as
its place's limit: one that comes out larger (a version of other outputs, say) comes in the reply's frames
instead, never over another request's block. A request whose tensors are under MIN_BYTES goes the usual way
(bench.gateway_hop: at 16 MiB a request over HTTP 1.13 x the bytes a second and the supervisor's CPU a request
28 % less, over gRPC 1.01 x and 42 % less; at 1 MiB no gain), as does one that finds no room; a BYTES input
always does.

The region is registered with the supervisor as a local client's is (the supervisor opens the file and reads
and writes it through its descriptor, never mapped), under the gateway's own name (protocol.GATEWAY_PEER),
and its name removed from /dev/shm at once: nothing is left there if either process dies, and it goes with
the gateway's connection (a new connection gets a new region: upstream.py). A block's pages are allocated
before it is used, so a full /dev/shm sends a request in frames rather than failing a write into the mapping.
A request's block is reused only once the supervisor has answered the request (one cancelled by its client may
still be computed and its outputs written) and nothing holds a view of its outputs any more.
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence

import msgspec
import numpy as np

from inferd import protocol
from inferd.protocol import Buffer, ReplyHeader, TensorMeta
from inferd.system.shm_names import GATEWAY_REGION_PREFIX, SHM_DIR

# A request's tensor bytes (inputs, and outputs of fixed size) from which they go here: bench.gateway_hop found
# a gain at 16 MiB a request and none at 1 MiB.
MIN_BYTES = 4 << 20
REGION_BYTES = 256 << 20  # what the region spans; only the pages in use are memory
ALIGN = mmap.PAGESIZE  # blocks start on pages, which is where their pages can be given back


class HopRegion:
    """The region and its free space: first fit over the free blocks, by offset."""

    def __init__(self, name: str, size: int = REGION_BYTES) -> None:
        self.name = name  # among the gateway's regions on its connection
        self.key = f"{GATEWAY_REGION_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(SHM_DIR / self.key, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(SHM_DIR / self.key)
            raise
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size) by offset, no two touching

    def registered(self) -> None:
        """The supervisor has the file open (or refused it): take its name out of /dev/shm."""
        os.unlink(SHM_DIR / self.key)

    def lease(self, inputs: Sequence[tuple[TensorMeta, Buffer | None]],
              output_bytes: Sequence[int | None]) -> Lease | None:
        """A block holding a copy of a request's inputs and room for its outputs of known size (`output_bytes`,
        None where the model decides); None where the request is small, an input lies in a client's region or
        is BYTES, or no block is free."""
        if any(data is None or meta.dtype == protocol.BYTES for meta, data in inputs):
            return None
        parts = [np.frombuffer(data, dtype=np.uint8) for _, data in inputs]  # type: ignore[arg-type]
        if sum(len(part) for part in parts) + sum(n or 0 for n in output_bytes) < MIN_BYTES:
            return None
        size = sum(_aligned(len(part)) for part in parts) + sum(_aligned(n or 0) for n in output_bytes)
        offset = self._take(size)
        if offset is None:
            return None
        try:
            os.posix_fallocate(self._fd, offset, size)
        except OSError:  # /dev/shm is full: a write into the mapping would kill the process
            self.release(offset, size)
            return None
        return Lease(self, offset, size, inputs, parts, output_bytes)

    def release(self, offset: int, size: int) -> None:
        """Give a block back, joined to the free blocks it touches."""
        index = bisect.bisect(self._free, (offset, size))
        if index < len(self._free) and offset + size == self._free[index][0]:
            size += self._free.pop(index)[1]
        if index and sum(self._free[index - 1]) == offset:
            offset, before = self._free.pop(index - 1)
            size += before
            index -= 1
        self._free.insert(index, (offset, size))

    def give_back(self) -> None:
        """Hand the system the pages of the free blocks: after a burst of large requests the region would
        otherwise keep the burst's size in memory."""
        for offset, size in self._free:
            self.mapping.madvise(mmap.MADV_REMOVE, offset, size)

    def _take(self, size: int) -> int | None:
        for index, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, free - size)
                return offset
        return None


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class Lease:
    """One request's block: its inputs copied in, their metadata naming the region, its outputs' places, and
    its answer read from there. The block goes back once the lease and every view of the answer are gone; the
    gateway's link to the supervisor holds the lease until the supervisor has answered."""

    def __init__(self, region: HopRegion, offset: int, size: int, inputs: Sequence[tuple[TensorMeta, Buffer | None]],
                 parts: Sequence[np.ndarray], output_bytes: Sequence[int | None]) -> None:
        # A view of the mapping of its own: memoryviews of it hold it, and the block is free once it is gone.
        self._block = np.frombuffer(region.mapping, dtype=np.uint8, count=size, offset=offset)
        weakref.finalize(self._block, region.release, offset, size)
        self._view = memoryview(self._block)  # type: ignore[arg-type]  # numpy arrays are buffers
        self._offset = offset
        at = 0
        self.inputs: list[tuple[TensorMeta, Buffer | None]] = []  # each input's metadata naming the region
        for (meta, _), part in zip(inputs, parts):
            self._block[at:at + len(part)] = part
            self.inputs.append((TensorMeta(meta.dtype, meta.shape, region.name, offset + at), None))
            at += _aligned(len(part))
        self.places: list[protocol.OutputPlace | None] = []
        for limit in output_bytes:
            self.places.append(protocol.OutputPlace(region.name, offset + at, limit) if limit else None)
            at += _aligned(limit or 0)

    def answer(self, reply: ReplyHeader, frames: list[memoryview]) -> tuple[ReplyHeader, list[memoryview]]:
        """The reply as if every output had come in a frame: those written in the region are views of it."""
        if not any(meta.region is not None for meta in reply.outputs):
            return reply, frames
        inline = iter(frames)
        outputs: list[memoryview] = []
        metas: list[TensorMeta] = []
        for meta in reply.outputs:
            if meta.region is None:
                outputs.append(next(inline))
                metas.append(meta)
                continue
            start = meta.offset - self._offset
            outputs.append(self._view[start:start + protocol.tensor_bytes(meta.dtype, meta.shape)])
            metas.append(TensorMeta(meta.dtype, meta.shape))
        return msgspec.structs.replace(reply, outputs=tuple(metas)), outputs
