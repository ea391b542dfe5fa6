"""The gateways handing a large request's tensors to the supervisor through a shared-memory region of their own,
instead of in the frames of its message, for bench.gateway_hop to measure one way against the other.

On a daemon's PYTHONPATH this file is imported by every process at start (Python's sitecustomize). With
INFERD_GATEWAY_SHM_KIB set, a gateway registers a region of its own with the supervisor (as a local client
registers one; the daemon needs server.allow_client_shm for the protocol) on its first request whose tensors
reach that many KiB, and from then on puts such a request's input bytes in a free slot of the region and asks its
one output written after them: the supervisor reads the inputs from the region into the batch's slot and writes
the output back there, and the gateway answers its client from there. With no slot free, a request goes
the usual way. A measurement of the hop, not a feature: a model of one output, and slots sized by
INFERD_GATEWAY_SHM_SLOT_MIB.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from inferd import protocol
from inferd.oip.upstream import Upstream
from inferd.system.shm_names import CLIENT_PREFIX

PEER = "gateway"
NAME = "gateway-hop"
SLOTS = 8


class GatewayRegion:
    """A region of SLOTS slots, each a request's inputs and then its output."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.key = f"{CLIENT_PREFIX}gateway-hop-{os.getpid()}"
        path = f"/dev/shm/{self.key}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, SLOTS * slot_bytes)
            self.map = mmap.mmap(fd, SLOTS * slot_bytes)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)
        self.free = list(range(SLOTS))

    async def register(self, upstream: Upstream) -> None:
        """Register the region with the supervisor, which keeps the file open; its name is then removed."""
        try:
            reply = await upstream.region(protocol.RegisterRegion, PEER, name=NAME, key=self.key, offset=0,
                                          byte_size=SLOTS * self.slot_bytes)
        finally:
            os.unlink(f"/dev/shm/{self.key}")
        if reply.status != protocol.OK:
            raise RuntimeError(f"the gateway's region was refused: {reply.error}")


_regions: dict[int, asyncio.Future[GatewayRegion]] = {}
_plain_infer = Upstream.infer


async def _region(upstream: Upstream) -> GatewayRegion:
    made = _regions.get(id(upstream))
    if made is None:
        made = _regions[id(upstream)] = asyncio.get_running_loop().create_future()
        region = GatewayRegion(int(os.environ.get("INFERD_GATEWAY_SHM_SLOT_MIB", "40")) << 20)
        await region.register(upstream)
        made.set_result(region)
    return await made


def _nbytes(meta: protocol.TensorMeta) -> int:
    return math.prod(meta.shape) * np.dtype(meta.dtype).itemsize


async def infer(self: Upstream, model: str, version: str | None,
                inputs: Sequence[tuple[protocol.TensorMeta, Any]], timeout_ms: int | None,
                outputs: Sequence[protocol.OutputPlace | None] = (), peer: str | None = None,
                priority: int | None = None) -> tuple[protocol.ReplyHeader, list[memoryview]]:
    """Upstream.infer, a large request's tensors through the gateway's region."""
    size = sum(len(data) for _, data in inputs if data is not None)
    if size < int(os.environ["INFERD_GATEWAY_SHM_KIB"]) << 10 or outputs or peer is not None:
        return await _plain_infer(self, model, version, inputs, timeout_ms, outputs, peer, priority)
    region = await _region(self)
    if not region.free or size >= region.slot_bytes // 2:
        return await _plain_infer(self, model, version, inputs, timeout_ms, outputs, peer, priority)
    slot = region.free.pop()
    try:
        at = slot * region.slot_bytes
        placed = []
        for meta, data in inputs:
            region.view[at:at + len(data)] = memoryview(data).cast("B")
            placed.append((msgspec.structs.replace(meta, region=NAME, offset=at), None))
            at += len(data)
        reply, _ = await _plain_infer(self, model, version, placed, timeout_ms, [protocol.OutputPlace(NAME, at)],
                                      PEER, priority)
        if reply.status != protocol.OK:
            return reply, []
        # Views of the slot, not copies: the front ends copy an answer's bytes into their response before they
        # next yield to the loop, so no other request takes the slot before then.
        frames = [region.view[m.offset:m.offset + _nbytes(m)] for m in reply.outputs]
        plain = tuple(msgspec.structs.replace(m, region=None, offset=0) for m in reply.outputs)
        return msgspec.structs.replace(reply, outputs=plain), frames
    finally:
        region.free.append(slot)


if os.environ.get("INFERD_GATEWAY_SHM_KIB"):
    Upstream.infer = infer  # type: ignore[method-assign]
