"""Triton's system shared-memory extension, for both front ends: a client's regions registered with
the supervisor on its behalf, the tensors' shared_memory_* parameters, and the regions' removal when
the client's connection is gone.

The supervisor keeps the regions and applies every rule (server.allow_client_shm, the name prefix, the
file checks); the gateway names the client by its connection (`peer`), so a region is its connection's
only. An address alone would not do: on loopback a port comes back as soon as its connection closes
(tcp_tw_reuse), so the name is the address and which connection it is. The HTTP server numbers its
connections and says when each ends. gRPC says neither, so the gateway names a gRPC connection by its
socket's inode and looks at its own established connections every SWEEP_S, unregistering the regions
of those gone; a connection's first region call looks its inode up afresh.

With server.client_shm_scope "server" the supervisor files every region under one owner, whoever
registered it, so the gateway names no connection (SERVER_PEER) and unregisters nothing when one ends.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import psutil

from inferd import protocol
from inferd.errors import InvalidRequest, quoted
from inferd.ipc import addresses
from inferd.oip.upstream import Upstream
from inferd.protocol import Buffer

log = logging.getLogger("inferd.oip.shm")

SWEEP_S = 1.0
EXTENSION = "system_shared_memory"
# Triton's CUDA shared-memory extension: none is registered, so its status and unregister answer as a
# server with none (Triton's tools ask both at start and end) and register is refused.
CUDA_REFUSED = "inferd takes no CUDA shared memory; register system shared memory (/dev/shm) instead"
SERVER_PEER = "server"  # the peer every region call and request names when regions are server-wide


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
            raise InvalidRequest(f"{what} has {key} {quoted(value)}; it must be a number of bytes")
    assert isinstance(size, int) and isinstance(offset, int)
    return InRegion(region, offset, size)


def region_response(meta: protocol.TensorMeta) -> dict[str, Any]:
    """The parameters of an output the supervisor wrote in a region: which, where, how many bytes."""
    size = meta.byte_size if meta.dtype == protocol.BYTES else protocol.tensor_bytes(meta.dtype, meta.shape)
    return {"shared_memory_region": meta.region, "shared_memory_offset": meta.offset,
            "shared_memory_byte_size": size}


def check_placed(names: Sequence[str], places: Sequence[protocol.OutputPlace | None],
                 outputs: Sequence[protocol.TensorMeta], frames: Sequence[Buffer]) -> None:
    """Raise InvalidRequest for an output asked for in a region that came back in the reply's `frames` instead:
    the model made it larger than the client's shared_memory_byte_size, which the daemon does not write past."""
    unplaced = iter(frames)
    for name, place, meta in zip(names, places or [None] * len(names), outputs):
        data = next(unplaced) if meta.region is None else None
        if place is not None and data is not None:
            raise InvalidRequest(f"output {name!r} came to {memoryview(data).nbytes} bytes, more than its "
                                 f"shared_memory_byte_size {place.byte_size}: give it a larger window")


def cuda_region_missing(name: str) -> str:
    """The sentence for a CUDA region asked for by name: there is none."""
    return f"no CUDA shared-memory region {quoted(name)} is registered ({CUDA_REFUSED})"


def peer_name(host: str, port: int) -> str:
    """A client's address as the gateway names it: host:port ([host]:port for IPv6). An IPv4 client of a
    dual-stack socket (gRPC listens on one even for an IPv4 address) is named by its IPv4 address, as gRPC
    names it, not as the socket's IPv4-mapped IPv6 one (::ffff:127.0.0.1), as the kernel lists it."""
    try:
        mapped = ipaddress.ip_address(host)
    except ValueError:
        mapped = None
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        host = str(mapped.ipv4_mapped)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_address(peer: str) -> str:
    """A gRPC peer ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000") by peer_name."""
    address = urllib.parse.unquote(peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer)
    host, port = addresses.split(address)
    return peer_name(host, int(port)) if port.isdigit() else peer


class SharedMemory:
    """The region calls of one front end, and the end of its clients' connections."""

    def __init__(self, upstream: Upstream, port: int, sweep: bool, enabled: bool, server_wide: bool) -> None:
        """`sweep`: the server does not say when a connection ends (gRPC), so look every SWEEP_S;
        `enabled`: whether server.allow_client_shm lets this front end's clients register regions;
        `server_wide`: whether they are every client's (server.client_shm_scope)."""
        self.enabled = enabled
        self.server_wide = server_wide
        self._upstream = upstream
        self._port = port
        self._sweep_connections = sweep
        self._with_regions: set[str] = set()  # the clients (peers) that registered regions
        self._inodes: dict[str, int] = {}  # a gRPC client's address -> its connection's socket inode
        self._sweeping: asyncio.Task[None] | None = None
        self._forgetting: set[asyncio.Task[None]] = set()  # held, or the loop may drop them unfinished

    def http_peer(self, connection: str) -> str:
        """The peer an HTTP connection's region calls and requests name."""
        return SERVER_PEER if self.server_wide else connection

    def grpc_peer(self, peer: str, fresh: bool = False) -> str:
        """A gRPC client connection's name: its address and its socket's inode (`fresh`: looked up now)."""
        if self.server_wide:
            return SERVER_PEER
        address = grpc_address(peer)
        if fresh or address not in self._inodes:
            self._inodes = self._established()
        return f"{address}/{self._inodes.get(address, 0)}"

    def closed(self, peer: str) -> None:
        """The client connection `peer` has ended: unregister its regions (from the loop, soon)."""
        if peer in self._with_regions:
            self._with_regions.discard(peer)
            task = asyncio.get_running_loop().create_task(self._forget(peer))
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)

    async def register(self, peer: str, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register `byte_size` bytes of shared memory `key` from `offset` on as `peer`'s region `name`."""
        if not isinstance(key, str):
            raise InvalidRequest("the register request's key must be a shared-memory name")
        for field, value, least in (("offset", offset, 0), ("byte_size", byte_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidRequest(f"the register request's {field} must be a number of bytes, at least {least}")
        await self._call(protocol.RegisterRegion, peer, name=name, key=key, offset=offset, byte_size=byte_size)
        if self.server_wide:
            return  # no connection's end unregisters it
        self._with_regions.add(peer)
        if self._sweep_connections and self._sweeping is None:
            self._sweeping = asyncio.get_running_loop().create_task(self._sweep())

    async def unregister(self, peer: str, name: str | None) -> None:
        """Unregister `peer`'s region `name`, or (None) all of them."""
        await self._call(protocol.UnregisterRegion, peer, name=name)

    async def status(self, peer: str, name: str | None) -> list[dict[str, Any]]:
        """`peer`'s region `name`, or (None) all of them: name, key, offset, byte_size each."""
        if name is None and not self.enabled:
            return []  # none can be registered; a named one is refused by the supervisor, with why
        regions = await self._call(protocol.RegionStatus, peer, name=name)
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    async def _call(self, kind: type[protocol.RegionOp], peer: str, **fields: Any) -> tuple[protocol.RegionInfo, ...]:
        name = fields.get("name")
        if name is not None and not protocol.REGION_NAME.match(name):
            raise InvalidRequest(f"{quoted(name)} is not a region name: letters, digits, '_', '.', '-', at most 200")
        reply = await self._upstream.region(kind, peer, **fields)
        if reply.status == protocol.INVALID:
            raise InvalidRequest(reply.error or reply.status)
        if reply.status != protocol.OK:  # the supervisor failed or did not answer: the protocol's 503
            raise ConnectionError(reply.error or reply.status)
        return reply.regions or ()

    async def _forget(self, peer: str) -> None:
        try:
            await self._call(protocol.UnregisterRegion, peer, name=None)
            log.info("client %s disconnected: its regions are unregistered", peer)
        except (InvalidRequest, ConnectionError) as exc:
            log.warning("unregistering the regions of %s, who disconnected: %s", peer, exc)

    def _established(self) -> dict[str, int]:
        """Each established connection to this front end's port: the client's address -> the socket's inode."""
        found = {}
        for connection in psutil.Process().net_connections("tcp"):
            if connection.status != psutil.CONN_ESTABLISHED or not connection.laddr or not connection.raddr \
                    or connection.laddr.port != self._port:
                continue
            try:
                found[peer_name(connection.raddr.ip, connection.raddr.port)] = os.fstat(connection.fd).st_ino
            except OSError:
                continue  # closed since it was listed
        return found

    async def _sweep(self) -> None:
        """Every SWEEP_S while a gRPC client has regions: unregister those of connections that are gone."""
        while self._with_regions:
            await asyncio.sleep(SWEEP_S)
            self._inodes = await asyncio.to_thread(self._established)  # /proc reads take milliseconds
            alive = {f"{address}/{inode}" for address, inode in self._inodes.items()}
            for peer in self._with_regions - alive:
                self.closed(peer)
        self._sweeping = None
