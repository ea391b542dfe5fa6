"""The frontend sockets' monitors and what they report: how many client connections are open, which
connections dropped (client_regions.py closes their regions), and whether a client waits that the daemon
cannot accept for want of descriptors.

Libzmq allows one monitor per socket; this module owns them. A monitor reports failed accepts too, but
out of descriptors ZeroMQ's I/O thread retries a waiting connection without pause, one report per retry,
and stops (with every connection it serves) whenever the monitor's queue is full: the loop would do
nothing but read them. So the loop looks at the listening socket itself once a tick instead (the monitor's
LISTENING report gives its descriptor): a connection waits there only while ZeroMQ cannot accept it, and
the loop then asks whether a descriptor is left. That is for tcp:// endpoints: at the limit, libzmq
4.3.5 aborts the process when a connection comes to an ipc:// one (docs/operations/faults.md).
"""

from __future__ import annotations

import logging
import select
from collections import Counter
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd.supervisor.intake import descriptors

log = logging.getLogger("inferd.frontend")

EVENTS = zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
WARN_EVERY_S = 60.0
REASONS = ("descriptors",)  # why a connection could not be accepted: the names in stats and metrics


class Connections:
    """Client connections as the frontend sockets' monitors report them."""

    def __init__(self) -> None:
        self.open = 0  # client connections open now, over the counted sockets
        self.refused: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self.monitors: dict[zmq.Socket, zmq.Socket] = {}  # a monitor -> the socket it reports on
        self._monitor_of: dict[zmq.Socket, zmq.Socket] = {}
        self._counted: set[zmq.Socket] = set()
        self._dropped: dict[zmq.Socket, Callable[[int], None]] = {}
        self._listeners: dict[int, str] = {}  # a counted socket's listening descriptor -> its endpoint
        self._waiting = select.poll()  # the listening descriptors, readable while a connection waits there
        self._next_warning = 0.0

    def count(self, socket: zmq.Socket) -> None:
        """Count `socket`'s connections and watch its listeners; call before it binds."""
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

    def on_monitor(self, monitor: zmq.Socket) -> None:
        """Handle the reports waiting on `monitor`."""
        socket = self.monitors[monitor]
        counted = socket in self._counted
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_DISCONNECTED:
                if counted:
                    self.open -= 1
                if socket in self._dropped:
                    self._dropped[socket](value)
            elif kind == zmq.EVENT_ACCEPTED and counted:
                self.open += 1
            elif kind == zmq.EVENT_LISTENING and counted and event["endpoint"].startswith(b"tcp://"):
                self._listeners[value] = event["endpoint"].decode()
                self._waiting.register(value, select.POLLIN)

    def check(self, now: float) -> None:
        """Once a tick: when a client waits on a listening socket and no descriptor is left to accept it,
        count it and say so (once a minute at most while it goes on)."""
        if now < self._next_warning or not self._listeners:
            return
        waiting = self._waiting.poll(0)
        if not waiting:
            return
        fd = waiting[0][0]
        why = descriptors.lacking(fd)
        if why is None:
            return
        self._next_warning = now + WARN_EVERY_S
        self.refused["descriptors"] += 1
        log.warning("a client connecting to %s cannot be accepted and waits unanswered until a connection closes: "
                    "%s. Until one does, keep inferctl away: a connection to an ipc:// endpoint would abort the "
                    "daemon (libzmq cannot accept it). Said once a minute while it lasts", self._listeners[fd],
                    descriptors.advice(why))

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
