"""The frontend's side of clients' shared memory: on which sockets it is allowed, whose regions a message
may use, region messages, a request's references resolved, and regions dropped with their connection.

A region's owner is its connection: a ZeroMQ peer's routing id on its socket, and for a gateway's
socket also the gateway's client (`peer`). Each registration is also filed under the transport
connection it came over (its descriptor, zmq.SRCFD), which the socket's monitor (connections.py) names
when it drops. With server.client_shm_scope "server", every gateway client's regions have one owner
(SERVER_OWNER), filed under no connection: they stay until unregistered, whichever connection or protocol
uses them.

A gateway's own region (oip/hop_region.py: its large requests' inputs), which it names with
protocol.GATEWAY_PEER, is allowed whatever server.allow_client_shm says: a gateway is the daemon's own
process, on a socket only the daemon's user can reach. Its shared-memory name is the gateways' (not a client's
prefix), and it goes with the gateway's connection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import zmq

from inferd import protocol
from inferd.config.schema import ServerConfig, client_shm_protocols
from inferd.errors import InvalidRequest, Overloaded
from inferd.ipc.addresses import loopback
from inferd.protocol import Buffer, RegionInfo
from inferd.supervisor.intake.connections import Connections
from inferd.supervisor.shared.regions import Place, Region, Regions, RegionSlice
from inferd.system import open_files
from inferd.system.shm_names import GATEWAY_REGION_PREFIX

log = logging.getLogger("inferd.frontend")

Owner = tuple[int, bytes, str | None]  # (socket, routing id, gateway peer)
Places = tuple[Place | None, ...]  # per output: where to write it
SERVER_OWNER: Owner = (0, b"", "server")


class ClientRegions:
    """Clients' regions as the frontend's sockets see them."""

    def __init__(self, regions: Regions, server: ServerConfig, connections: Connections) -> None:
        self.regions = regions
        self._connections = connections
        self._allowed: set[zmq.Socket] = set()  # the sockets regions are allowed on
        self._names: dict[zmq.Socket, str] = {}
        self._gateways: dict[zmq.Socket, str] = {}
        self._protocols = client_shm_protocols(server)
        self._server_wide = server.client_shm_scope == "server"

    def add(self, socket: zmq.Socket, name: str, address: str, protocol_name: str, gateway: bool) -> None:
        """Note a client-facing socket: regions are allowed on it if its protocol's are and `address` (where
        its clients connect) is ipc:// or loopback; then its monitor reports connections that drop."""
        self._names[socket] = name
        if gateway:
            self._gateways[socket] = protocol_name
            self._connections.on_drop(socket, lambda fd: self._dropped(socket, fd))
        if protocol_name not in self._protocols:
            return
        if not (address.startswith("ipc://") or loopback(address)):
            log.warning("client shared memory stays off on %s %s: it is reachable beyond this machine", name, address)
            return
        self._allowed.add(socket)
        if not gateway:
            self._connections.on_drop(socket, lambda fd: self._dropped(socket, fd))
        log.info("client shared memory allowed on %s", name)

    def _dropped(self, socket: zmq.Socket, fd: int) -> None:
        """Close the regions of the connection of `socket` on descriptor `fd`, which dropped."""
        dropped = self.regions.drop_link((id(socket), fd))
        if dropped:
            log.info("a connection to %s dropped: its %d region(s) unregistered", self._names[socket], dropped)

    def message(self, socket: zmq.Socket, identity: bytes, op: protocol.RegionOp,
                first: zmq.Frame | None) -> tuple[RegionInfo, ...]:
        """Register, unregister or list the connection's regions: those concerned, or InvalidRequest (Overloaded
        for a region the clients' share of descriptors has no room for)."""
        owner = self._owner(socket, identity, op.peer, op.id)
        try:
            if isinstance(op, protocol.RegisterRegion):
                # A connection is known by its descriptor, which the next connection may reuse; ZeroMQ
                # reports a disconnect before it closes the descriptor, so before a later connection on
                # it can send anything: taking the reports first keeps an old drop off the new connection.
                self._connections.take(socket)
                link = (id(socket), first.get(zmq.SRCFD)) if first is not None and owner is not SERVER_OWNER \
                    else None
                own = op.peer == protocol.GATEWAY_PEER
                if not own and not self._connections.room():
                    budget = self._connections.budget
                    raise Overloaded(f"the daemon has no descriptor left for another region: its clients hold all "
                                     f"{budget.for_clients} that its open-files limit of {budget.limit} leaves "
                                     "them; unregister regions no longer used, or have the operator "
                                     f"{open_files.RAISE_LIMIT}", op.id)
                who = (f"the {self._gateways[socket]} gateway" if own
                       else f"{self._gateways[socket]} client {op.peer}" if op.peer is not None
                       else f"{self._names[socket]} connection {identity.hex()}")
                regions = [self.regions.register(owner, op.name, op.key, op.offset, op.byte_size, describe=who,
                                                 link=link, prefix=GATEWAY_REGION_PREFIX if own else None)]
                log.info("region %r (shared memory %s, %d bytes from %d) registered by %s", op.name,
                         regions[0].key, op.byte_size, op.offset, who)
            elif isinstance(op, protocol.UnregisterRegion):  # a name not registered is already unregistered
                regions = [r for r in self.regions.of(owner) if op.name in (None, r.name)]
                self.regions.unregister(owner, op.name)
            else:
                regions = self.regions.of(owner, op.name)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, op.id) from None
        return tuple(RegionInfo(r.name, r.key, r.offset, r.size) for r in regions)

    def resolve(self, socket: zmq.Socket, identity: bytes, header: protocol.RequestHeader,
                buffers: Sequence[Buffer | None]) -> tuple[list[Buffer | RegionSlice], Places]:
        """A request's inputs with each one in a region resolved against its connection's regions, and
        where each output goes; InvalidRequest if a region is not the connection's or too small."""
        owner = self._owner(socket, identity, header.peer, header.id)
        sizes = protocol.input_sizes(header.inputs, header.id)
        used: set[Region] = set()
        resolved: list[Buffer | RegionSlice] = []
        places: list[Place | None] = []
        try:
            for index, (meta, buffer) in enumerate(zip(header.inputs, buffers)):
                if buffer is not None:
                    resolved.append(buffer)
                    continue
                assert meta.region is not None  # decode_message leaves None only for inputs in a region
                region = self.regions.get(owner, meta.region)
                size = sizes[index]
                if size is None:  # BYTES: the bytes its elements take, as the client says
                    if meta.byte_size is None:
                        raise InvalidRequest(f"input {index} is bytes in region {meta.region!r}: give its byte_size")
                    size = meta.byte_size
                region.check(meta.offset, size, f"input {index}")
                resolved.append(RegionSlice(region, meta.offset, size))
                used.add(region)
            for place in header.outputs:
                if place is None:
                    places.append(None)
                    continue
                region = self.regions.get(owner, place.region)
                region.check(place.offset, place.byte_size or 0, "an output")
                used.add(region)
                places.append(Place(region, place.offset, place.byte_size))
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, header.id) from None
        for region in used:
            region.requests += 1
        return resolved, tuple(places)

    def close(self) -> None:
        """Close every region."""
        self.regions.close()

    def _owner(self, socket: zmq.Socket, identity: bytes, peer: str | None,
               request_id: protocol.RequestId) -> Owner:
        if peer == protocol.GATEWAY_PEER and socket in self._gateways:
            return (id(socket), identity, peer)
        if socket not in self._allowed:
            where = "" if self._protocols else " (server.allow_client_shm is off)"
            raise InvalidRequest(f"client shared memory is not allowed on {self._names[socket]}{where}; "
                                 "it is only ever allowed over ipc:// and loopback endpoints", request_id)
        if (peer is None) != (socket not in self._gateways):
            raise InvalidRequest("`peer` is for the daemon's own gateways, and they always give it", request_id)
        if self._server_wide and peer is not None:
            return SERVER_OWNER
        return (id(socket), identity, peer)
