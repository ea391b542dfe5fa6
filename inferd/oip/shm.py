"""Triton's system shared-memory extension, for both front ends: a client's regions registered with
the supervisor on its behalf, the tensors' shared_memory_* parameters, and the regions' removal when
the client's connection is gone.

The supervisor keeps the regions and applies every rule (server.allow_client_shm, the name prefix, the
file checks); the gateway names the client by its connection (`peer`, the address it connects from),
so a region is its connection's only. Neither HTTP nor gRPC says when a connection closes, so the
gateway looks at its own established connections every SWEEP_S and unregisters the regions of peers
no longer among them (a peer's address cannot come back sooner: TCP's TIME_WAIT holds it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import urllib.parse
from collections.abc import Mapping
from typing import Any, NamedTuple

import psutil

from inferd import protocol
from inferd.errors import InvalidRequest
from inferd.oip.upstream import Upstream

log = logging.getLogger("inferd.oip.shm")

SWEEP_S = 1.0
EXTENSION = "system_shared_memory"


class InRegion(NamedTuple):
    """Where a tensor's bytes lie, as its shared_memory_* parameters say."""

    region: str
    offset: int
    byte_size: int


def region_parameters(parameters: Mapping[str, Any], what: str) -> InRegion | None:
    """A tensor's shared_memory_region / _offset / _byte_size parameters; None if it names no region."""
    region = parameters.get("shared_memory_region")
    if region is None:
        return None
    size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if not isinstance(region, str) or not region:
        raise InvalidRequest(f"{what} has a shared_memory_region that is not a name")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequest(f"{what} has {key} {value!r}; it must be a number of bytes")
    assert isinstance(size, int) and isinstance(offset, int)
    return InRegion(region, offset, size)


def region_response(meta: protocol.TensorMeta) -> dict[str, Any]:
    """The parameters of an output the supervisor wrote in a region: which, where, how many bytes."""
    size = math.prod(meta.shape) * protocol.DTYPES[meta.dtype].itemsize
    return {"shared_memory_region": meta.region, "shared_memory_offset": meta.offset,
            "shared_memory_byte_size": size}


def peer_name(host: str, port: int) -> str:
    """How the gateway names a client to the supervisor: the address it connects from."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_peer(peer: str) -> str:
    """A gRPC peer ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000") by peer_name."""
    address = urllib.parse.unquote(peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer)
    host, _, port = address.rpartition(":")
    return peer_name(host.strip("[]"), int(port)) if port.isdigit() else peer


def _address(peer: str) -> tuple[str, int] | None:
    host, _, port = peer.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() and host else None


class SharedMemory:
    """The region calls of one front end, and the sweep of its clients' connections."""

    def __init__(self, upstream: Upstream, port: int) -> None:
        self._upstream = upstream
        self._port = port
        self._peers: set[tuple[str, int]] = set()  # peers that registered regions
        self._sweeping: asyncio.Task[None] | None = None

    async def register(self, peer: str, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register `byte_size` bytes of shared memory `key` from `offset` on as `peer`'s region `name`."""
        address = self._local(peer)
        for field, value in (("key", key), ("offset", offset), ("byte_size", byte_size)):
            if field == "key" and not isinstance(value, str):
                raise InvalidRequest("the register request's key must be a shared-memory name")
            if field != "key" and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidRequest(f"the register request's {field} must be a number of bytes")
        await self._call(protocol.RegisterRegion, peer, name=name, key=key, offset=offset, byte_size=byte_size)
        self._peers.add(address)
        if self._sweeping is None:
            self._sweeping = asyncio.get_running_loop().create_task(self._sweep())

    async def unregister(self, peer: str, name: str | None) -> None:
        """Unregister `peer`'s region `name`, or (None) all of them."""
        await self._call(protocol.UnregisterRegion, peer, name=name)

    async def status(self, peer: str, name: str | None) -> list[dict[str, Any]]:
        """`peer`'s region `name`, or (None) all of them: name, key, offset, byte_size each."""
        regions = await self._call(protocol.RegionStatus, peer, name=name)
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    def _local(self, peer: str) -> tuple[str, int]:
        address = _address(peer)
        if address is None:
            raise InvalidRequest("client shared memory is for clients on this machine; this one's address is unknown")
        return address

    async def _call(self, kind: type[protocol.RegionOp], peer: str, **fields: Any) -> tuple[protocol.RegionInfo, ...]:
        name = fields.get("name")
        if name is not None and not protocol.REGION_NAME.match(name):
            raise InvalidRequest(f"{name!r} is not a region name: letters, digits, '_', '.', '-', at most 200")
        reply = await self._upstream.region(kind, peer, **fields)
        if reply.status != protocol.OK:
            raise InvalidRequest(reply.error or reply.status)
        return reply.regions or ()

    async def _sweep(self) -> None:
        """Every SWEEP_S while some peer has regions: unregister those of peers whose connection is gone."""
        while self._peers:
            await asyncio.sleep(SWEEP_S)
            connected = {(c.raddr.ip, c.raddr.port) for c in psutil.Process().net_connections("tcp")
                         if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == self._port and c.raddr}
            for host, port in self._peers - connected:
                self._peers.discard((host, port))
                peer = peer_name(host, port)
                try:
                    await self._call(protocol.UnregisterRegion, peer, name=None)
                    log.info("client %s disconnected: its regions are unregistered", peer)
                except InvalidRequest as exc:
                    log.warning("unregistering the regions of %s, who disconnected: %s", peer, exc.message)
        self._sweeping = None
