"""sd_notify without a dependency: one datagram to $NOTIFY_SOCKET per state change.

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
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


class StatusReport:
    """What systemd hears while serving: WATCHDOG=1 while nothing is hung, STATUS= every few seconds."""

    def __init__(self) -> None:
        self.watchdog = Watchdog()
        self._hung: str | None = None
        self._next_status = 0.0
        self._replies_then = 0

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
