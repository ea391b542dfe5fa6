"""sd_notify without a dependency: one datagram to $NOTIFY_SOCKET per state change.

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger("inferd.system.systemd")


def notify(*fields: str) -> bool:
    """Send `fields` (such as "READY=1", "STATUS=...") to systemd; False when there is no one to tell."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
        return True
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", address, exc)
        return False


class Watchdog:
    """WATCHDOG=1 pings at half the period systemd asked for ($WATCHDOG_USEC), if it asked this process."""

    def __init__(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or (pid.isdigit() and int(pid) == os.getpid())
        self.interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._next = 0.0

    def wait(self, now: float) -> float | None:
        """Seconds until the next ping is due; None without a watchdog."""
        return None if self.interval is None else max(0.0, self._next - now)

    def ping(self, now: float) -> None:
        """Ping if one is due."""
        if self.interval is not None and now >= self._next:
            notify("WATCHDOG=1")
            self._next = now + self.interval


STATUS_EVERY_S = 2.0


class Systemd:
    """What systemd hears of the daemon: READY=1 once it serves, RELOADING=1 and READY=1 around its changes
    (a SIGHUP, a reload), STOPPING=1 when it stops; WATCHDOG=1 while nothing is hung, STATUS= every few seconds.

    A change made before the daemon serves, or still under way once it stops, is not said: systemd would take
    READY=1 for a start that has not finished, or for a stop undone."""

    def __init__(self) -> None:
        self.watchdog = Watchdog()
        self._hung: str | None = None
        self._next_status = 0.0
        self._replies_then = 0
        self._serving = False
        self._changes = 0  # under way: READY=1 again when the last one ends
        self._reloading_said = False

    def serving(self) -> None:
        """The daemon has started and serves."""
        self._serving = True
        notify("READY=1")

    def changing(self) -> None:
        """A change begins."""
        self._changes += 1
        if self._serving and not self._reloading_said:
            self._reloading_said = True
            notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def changed(self) -> None:
        """A change that `changing` began has ended, made or not."""
        self._changes -= 1
        if self._changes == 0 and self._reloading_said and self._serving:
            self._reloading_said = False
            notify("READY=1")

    def stopping(self) -> None:
        """The daemon stops: from now on systemd hears neither READY=1 nor RELOADING=1."""
        self._serving = False
        notify("STOPPING=1")

    def report(self, now: float, hung: str | None, status: Callable[[], tuple[str, int]]) -> None:
        """Ping unless `hung` names what stopped making progress; when STATUS= is due (or `hung` changed),
        send `status()`'s summary with the request rate its reply count gives."""
        changed = hung != self._hung
        if changed:
            if hung:
                log.error("watchdog pings stop: %s", hung)
            else:
                log.info("watchdog pings resume")
            self._hung = hung
        if hung is None:
            self.watchdog.ping(now)
        if now >= self._next_status or changed:
            summary, replies = status()
            rate = (replies - self._replies_then) / (now - self._next_status + STATUS_EVERY_S)
            self._replies_then, self._next_status = replies, now + STATUS_EVERY_S
            notify(f"STATUS={summary}; {rate:.0f} requests/s" + (f"; HUNG: {hung}" if hung else ""))
