"""The frontend sockets' monitors and what they report: how many client connections are open, which
connections dropped (client_regions.py closes their regions), and the connections turned away so that
clients never hold more descriptors than descriptors.Budget leaves them.

A connection past the budget is closed as soon as the monitor reports it accepted: its client's ZeroMQ
connects again (every 100 ms by default: libzmq backs off only from connections that fail, not from
connections that end), and is taken once another connection has closed. ZeroMQ accepts a burst of new
connections before the loop hears of them; the reserve is what a burst may take.

It is closed by its descriptor, which libzmq may have closed and given to a newer connection by the time
the loop reads the report: so the loop reads every report waiting first (a drop reported after the accept
leaves the descriptor alone), and closes only a socket whose own address is the endpoint's, held by a
duplicate of the descriptor while it is checked.

Libzmq allows one monitor per socket; this module owns them. A monitor reports failed accepts too, but
out of descriptors ZeroMQ's I/O thread retries a waiting connection without pause, one report per retry,
and stops (with every connection it serves) whenever the monitor's queue is full: the loop would do
nothing but read them. So the loop looks at the listening socket itself once a tick instead (the monitor's
LISTENING report gives its descriptor): a connection waits there only while ZeroMQ cannot accept it, and
the loop then asks whether a descriptor is left; with the budget kept, that is when the whole system has
none (ENFILE), or the daemon's own work outgrew its reserve. That is for tcp:// endpoints: out of
descriptors, libzmq 4.3.5 aborts the process when a connection comes to an ipc:// one
(docs/operations/faults.md).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket as socket_module
import time
from collections import Counter
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd.supervisor.intake import descriptors
from inferd.supervisor.shared.regions import Regions
from inferd.system import open_files

log = logging.getLogger("inferd.frontend")

EVENTS = zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
CLIENTS_DOMAIN = "inferd.clients"  # the ZAP domain of the counted sockets (handshakes.py)
HANDSHAKE_MS = 10_000  # a counted connection's handshake (ZMTP, CURVE) must be done by then
WARN_EVERY_S = 60.0
REASONS = ("descriptors",)  # why a connection was turned away or not accepted: the names in stats and metrics


class Connections:
    """Client connections as the frontend sockets' monitors report them."""

    def __init__(self, regions: Regions) -> None:
        self.open = 0  # client connections open now, over the counted sockets
        self.budget = descriptors.Budget()
        self.refused: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self._regions = regions
        self.monitors: dict[zmq.Socket, zmq.Socket] = {}  # a monitor -> the socket it reports on
        self._monitor_of: dict[zmq.Socket, zmq.Socket] = {}
        self._counted: set[zmq.Socket] = set()
        self._dropped: dict[zmq.Socket, Callable[[int], None]] = {}
        self._listeners: dict[int, str] = {}  # a counted socket's listening descriptor -> its endpoint
        self._waiting = select.poll()  # the listening descriptors, readable while a connection waits there
        self._next_warning = 0.0
        self._next_turned_away_warning = 0.0
        self._closing: set[int] = set()  # descriptors of connections turned away, whose drop is not reported yet

    @property
    def held(self) -> int:
        """The descriptors clients hold: their connections and their regions."""
        return self.open + self._regions.held

    def room(self) -> bool:
        """Whether clients may take one more descriptor (a connection or a region)."""
        return self.held < self.budget.for_clients

    def count_own(self, now: float) -> None:
        """Count the descriptors the daemon's own work holds now (when its sockets are bound and its
        workers connected), which the clients' budget leaves it."""
        self.budget.count_own(self.held, now)

    def count(self, socket: zmq.Socket) -> None:
        """Count `socket`'s connections against the clients' share of descriptors, turning away those past it,
        and watch its listeners; call before it binds."""
        # Every connection's handshake waits for the loop's ZAP answer, which comes after its report has been
        # read (handshakes.py): one turned away never sent a request.
        socket.zap_domain = CLIENTS_DOMAIN.encode()
        # One that never finishes its handshake holds a descriptor until then: libzmq's default allows it 30 s,
        # the gateways allow 10.
        socket.handshake_ivl = HANDSHAKE_MS
        self._counted.add(socket)
        self._monitor(socket)

    def on_drop(self, socket: zmq.Socket, dropped: Callable[[int], None]) -> None:
        """Call `dropped` with the descriptor of each connection of `socket` that drops."""
        self._dropped[socket] = dropped
        self._monitor(socket)

    def take(self, socket: zmq.Socket) -> None:
        """Handle what `socket`'s monitor has reported so far."""
        monitor = self._monitor_of.get(socket)
        if monitor is not None:
            self.on_monitor(monitor)

    def take_all(self) -> None:
        """Handle what every monitor has reported so far."""
        for monitor in list(self.monitors):
            self.on_monitor(monitor)

    def on_monitor(self, monitor: zmq.Socket) -> None:
        """Handle the reports waiting on `monitor`: every one of them, before a connection is turned away."""
        socket = self.monitors[monitor]
        counted = socket in self._counted
        events = []
        while monitor.poll(0):
            events.append(parse_monitor_message(monitor.recv_multipart()))
        turn_away: dict[int, str] = {}  # descriptor -> the endpoint it was accepted at
        for event in events:
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_DISCONNECTED:
                if turn_away.pop(value, None) is None and counted:
                    if value in self._closing:
                        self._closing.discard(value)  # turned away before: never counted open
                    else:
                        self.open -= 1
                if socket in self._dropped:
                    self._dropped[socket](value)
            elif kind == zmq.EVENT_ACCEPTED and counted:
                if self.room():
                    self.open += 1
                else:
                    turn_away[value] = event["endpoint"].decode()
            elif kind == zmq.EVENT_LISTENING and counted and event["endpoint"].startswith(b"tcp://"):
                self._listeners[value] = event["endpoint"].decode()
                self._waiting.register(value, select.POLLIN)
        for fd, endpoint in turn_away.items():
            # Whether closed here or gone already (its descriptor no longer that endpoint's), its drop is
            # still to be reported.
            self._closing.add(fd)
            close_accepted(fd, endpoint)
            self._turned_away(endpoint)

    def _turned_away(self, endpoint: str) -> None:
        self.refused["descriptors"] += 1
        now = time.monotonic()
        if now < self._next_turned_away_warning:
            return
        self._next_turned_away_warning = now + WARN_EVERY_S
        log.warning("a client connecting to %s was turned away, to be taken when a connection closes: clients "
                    "hold all %d descriptors that the daemon's open-files limit of %d leaves them (it keeps %d in "
                    "reserve and its own work holds %d); %s. Said once a minute while it lasts", endpoint,
                    self.budget.for_clients, self.budget.limit, self.budget.reserve, self.budget.own,
                    open_files.RAISE_LIMIT)

    def check(self, now: float) -> None:
        """Once a tick: when a client waits on a listening socket and no descriptor is left to accept it,
        count it and say so (once a minute at most while it goes on). And while clients hold nearly all the
        budget leaves them, count what the daemon's own work holds again (the reports read first, so that
        no connection is counted on both sides)."""
        self.take_all()
        self.budget.recount(self.held, now)
        if now < self._next_warning or not self._listeners:
            return
        waiting = self._waiting.poll(0)
        if not waiting:
            return
        fd = waiting[0][0]
        why = open_files.lacking(fd)
        if why is None:
            return
        self._next_warning = now + WARN_EVERY_S
        self.refused["descriptors"] += 1
        log.warning("a client connecting to %s cannot be accepted and waits unanswered until a connection closes: "
                    "%s. Until one does, keep inferctl away: a connection to an ipc:// endpoint would abort the "
                    "daemon (libzmq cannot accept it). Said once a minute while it lasts", self._listeners[fd],
                    open_files.advice(why))

    def close(self) -> None:
        """Stop the monitors."""
        for monitor, socket in self.monitors.items():
            socket.disable_monitor()
            monitor.close(linger=0)
        self.monitors, self._monitor_of = {}, {}
        for fd in self._listeners:
            self._waiting.unregister(fd)
        self._listeners = {}

    def _monitor(self, socket: zmq.Socket) -> None:
        if socket in self._monitor_of:
            return
        address = f"inproc://inferd.monitor.{len(self._monitor_of)}"
        socket.monitor(address, EVENTS)
        monitor = socket.context.socket(zmq.PAIR)
        # No bound on the reports queued: at a bound, ZeroMQ's I/O thread would wait for the loop to read
        # them, holding the lock that disable_monitor() takes.
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(address)
        self.monitors[monitor] = socket
        self._monitor_of[socket] = monitor


def close_accepted(fd: int, endpoint: str) -> bool:
    """Shut the connection ZeroMQ accepted on descriptor `fd` at `endpoint` (ZeroMQ sees it end, and closes
    it); False if `fd` is no longer one of that endpoint's connections."""
    try:
        # A duplicate holds the socket checked until it is shut, whatever becomes of `fd` meanwhile.
        pinned: int | None = os.dup(fd)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            return False  # closed meanwhile
        pinned = None  # no descriptor left for one, which is when this matters most: `fd` itself, then
    try:
        accepted = socket_module.socket(fileno=fd if pinned is None else pinned)
    except OSError:  # no longer a socket
        if pinned is not None:
            os.close(pinned)
        return False
    try:
        if not is_at(accepted.getsockname(), endpoint):
            return False
        accepted.shutdown(socket_module.SHUT_RDWR)
    except OSError:
        return False
    finally:
        if pinned is None:
            accepted.detach()  # `fd` stays ZeroMQ's to close
        else:
            accepted.close()
    return True


def is_at(address: object, endpoint: str) -> bool:
    """Whether a socket's own `address` (getsockname's) is that of a connection accepted at `endpoint`."""
    transport, _, where = endpoint.partition("://")
    if transport == "tcp":
        return isinstance(address, tuple) and str(address[1]) == where.rpartition(":")[2]
    if transport == "ipc":
        path = "\0" + where[1:] if where.startswith("@") else where
        return address in (path, path.encode())
    return False
