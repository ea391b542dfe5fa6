"""The daemons a Client talks to: one socket per endpoint, and what the client knows of each one's health.

A client given several endpoints, or a DNS name that resolves to several
addresses (a Kubernetes headless Service), keeps one DEALER socket per
address. Requests go to the endpoint with the fewest requests outstanding.
An endpoint that drops its connection or answers `unavailable` rests for a
cool-down that doubles with each failure in a row; one that answers
`overloaded` rests briefly. After resting, an endpoint gets one request (the
probe) and only a good answer brings it fully back. Resting endpoints are
still used when no other endpoint is connected, so a client of a single
daemon behaves as it always did.
"""

from __future__ import annotations

import ipaddress
import socket as socket_module
import threading
from collections.abc import Callable, Iterable, Sequence

import zmq

from inferd import protocol

# Connection events that change an endpoint's health.
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# (first rest, longest rest) in seconds, for an endpoint that failed and for one that shed load.
FAILURE_REST = (1.0, 10.0)
OVERLOAD_REST = (0.05, 1.0)
# ZMTP heartbeats find a peer that vanished without closing its connection (a node lost
# from the network) in seconds instead of at each request's deadline.
HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RECONNECT_MAX_MS = 2000

Secure = Callable[[zmq.Socket], None]


class Endpoint:
    """One daemon address: its socket, its requests in flight, and whether to send to it now."""

    def __init__(self, context: zmq.Context, address: str, secure: Secure) -> None:
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.ipv6 = True
        # Queue only to a connection whose handshake is done, so a send to a daemon that
        # is down fails at once (and goes elsewhere) instead of waiting for it to return.
        self.socket.immediate = True
        self.socket.heartbeat_ivl = HEARTBEAT_MS
        self.socket.heartbeat_timeout = HEARTBEAT_TIMEOUT_MS
        self.socket.reconnect_ivl_max = RECONNECT_MAX_MS
        secure(self.socket)
        self.monitor = self.socket.get_monitor_socket(EVENTS)
        self.socket.connect(address)
        self.in_flight: set[int] = set()
        self.connected = False
        self.refused = False
        self.retired = False
        self.strikes = 0
        self.rest_until = 0.0

    def resting(self, now: float) -> bool:
        """Whether to pass this endpoint over while another one can take the request."""
        if now < self.rest_until:
            return True
        return bool(self.strikes and self.in_flight)  # its probe is still out

    def answered(self, status: str, now: float) -> None:
        """Note what the daemon answered."""
        if status == protocol.OVERLOADED:
            self._rest(OVERLOAD_REST, now)
        elif status == protocol.UNAVAILABLE:
            self._rest(FAILURE_REST, now)
        else:
            # A good answer shortens the next rest but does not end this one: replies to
            # requests sent before the daemon shed load say nothing of its state now.
            self.strikes = 0

    def dropped(self, now: float) -> set[int]:
        """The connection went down: rest, and hand back the ids of the requests it took with it."""
        self.connected = False
        self._rest(FAILURE_REST, now)
        lost, self.in_flight = self.in_flight, set()
        return lost

    def close(self) -> None:
        """Close the socket and its monitor."""
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()

    def _rest(self, rest: tuple[float, float], now: float) -> None:
        self.strikes += 1
        first, longest = rest
        doublings = min(self.strikes - 1, 16)  # the cap is reached long before; this keeps the float finite
        self.rest_until = now + min(longest, first * 2**doublings)


def resolve(address: str) -> list[str] | None:
    """The addresses a tcp:// endpoint's host name stands for; None when it names one address already.

    An empty list means the name did not resolve (yet): a headless Service with
    no ready pod has no addresses.
    """
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or host == "*" or host.startswith("["):
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        infos = socket_module.getaddrinfo(host, int(port), type=socket_module.SOCK_STREAM)
    except (OSError, ValueError):
        return []
    found = sorted({str(info[4][0]) for info in infos})
    return [f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in found]


class EndpointPool:
    """Every endpoint of a client, kept in step with DNS, ranked for each send."""

    def __init__(self, context: zmq.Context, addresses: Sequence[str], secure: Secure) -> None:
        if not addresses:
            raise ValueError("a client needs at least one endpoint")
        self._context = context
        self._secure = secure
        self.endpoints: dict[str, Endpoint] = {}
        self.names: dict[str, set[str]] = {}  # a host name → the addresses it resolved to
        self._given: set[str] = set()  # addresses given as such: DNS never retires them
        self._turn = 0
        for address in addresses:
            found = resolve(address)
            if found is None:
                self._given.add(address)
                self._add(address)
            else:
                self.names[address] = set()
                self.update(address, found)

    def ranked(self, avoid: Endpoint | None, now: float) -> list[Endpoint]:
        """Connected endpoints, best first: not resting, not `avoid`, fewest requests outstanding.

        Ties go round-robin, so even one request at a time spreads over all endpoints.
        """
        usable = [ep for ep in self.endpoints.values() if ep.connected and not ep.retired]
        if not usable:
            return []
        self._turn = (self._turn + 1) % len(usable)
        usable = usable[self._turn:] + usable[:self._turn]
        return sorted(usable, key=lambda ep: (ep.resting(now), ep is avoid, len(ep.in_flight)))

    def refused_everywhere(self) -> bool:
        """Whether every endpoint turned this client's CURVE key away and none is connected."""
        live = [ep for ep in self.endpoints.values() if not ep.retired]
        return bool(live) and all(ep.refused and not ep.connected for ep in live)

    def update(self, name: str, addresses: Iterable[str]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Take the addresses `name` now resolves to; return the endpoints added and those retired.

        A retired endpoint takes no new requests; its socket stays open until what it
        has in flight is answered. A failed lookup (no addresses) changes nothing:
        a DNS hiccup must not take every daemon away.
        """
        new = set(addresses)
        if not new:
            return [], []
        old = self.names.get(name, set())
        self.names[name] = new
        still_named = set().union(self._given, *self.names.values())
        added = []
        for address in sorted(new - old):
            if address in self.endpoints:
                self.endpoints[address].retired = False
            else:
                added.append(self._add(address))
        retired = []
        for address in sorted(old - still_named):
            endpoint = self.endpoints[address]
            endpoint.retired = True
            retired.append(endpoint)
        return added, retired

    def remove(self, endpoint: Endpoint) -> None:
        """Close a retired endpoint whose requests are all answered."""
        if self.endpoints.get(endpoint.address) is endpoint:
            del self.endpoints[endpoint.address]
        endpoint.close()

    def describe(self) -> str:
        """The endpoints as a person reads them, for error messages."""
        parts = [ep.address for ep in self.endpoints.values() if not ep.retired]
        parts += [f"{name} (did not resolve)" for name, found in self.names.items() if not found]
        return ", ".join(parts)

    def close(self) -> None:
        """Close every socket."""
        for endpoint in self.endpoints.values():
            endpoint.close()
        self.endpoints.clear()

    def _add(self, address: str) -> Endpoint:
        endpoint = Endpoint(self._context, address, self._secure)
        self.endpoints[address] = endpoint
        return endpoint


class Resolver(threading.Thread):
    """Looks host names up again every `interval` seconds (every second while one has no address).

    Lookups block, so they run here and not on the client's I/O thread; results
    go to `deliver(name, addresses)`.
    """

    def __init__(self, names: Iterable[str], interval: float,
                 deliver: Callable[[str, list[str]], None]) -> None:
        super().__init__(name="inferd-client-dns", daemon=True)
        self._names = list(names)
        self._interval = interval
        self._deliver = deliver
        self._stop = threading.Event()
        self._unresolved = True

    def run(self) -> None:
        while not self._stop.wait(1.0 if self._unresolved else self._interval):
            self._unresolved = False
            for name in self._names:
                found = resolve(name) or []
                self._unresolved |= not found
                self._deliver(name, found)

    def stop(self) -> None:
        """Stop looking up; returns at once."""
        self._stop.set()
