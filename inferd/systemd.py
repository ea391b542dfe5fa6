"""sd_notify without a dependency: one datagram to $NOTIFY_SOCKET per state change.

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("inferd.systemd")


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
