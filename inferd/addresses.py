"""Addresses as configs write them: HOST:PORT and tcp://HOST:PORT, IPv6 hosts in brackets."""

from __future__ import annotations


def split(address: str) -> tuple[str, str]:
    """The host (brackets removed) and the port of `HOST:PORT` or `tcp://HOST:PORT`; either may be empty."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def loopback(address: str) -> bool:
    """Whether a tcp:// endpoint or a HOST:PORT address is reachable only from this machine."""
    host = split(address)[0]
    return host in ("localhost", "::1") or host.startswith("127.")
