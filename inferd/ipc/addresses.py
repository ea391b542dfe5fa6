"""Addresses as configs write them: HOST:PORT and tcp://HOST:PORT, IPv6 hosts in brackets."""

from __future__ import annotations

import ipaddress


def split(address: str) -> tuple[str, str]:
    """The host (brackets removed) and the port of `HOST:PORT` or `tcp://HOST:PORT`; either may be empty."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def loopback(address: str) -> bool:
    """Whether a tcp:// endpoint or a HOST:PORT address is reachable only from this machine."""
    return loopback_host(split(address)[0])


def loopback_host(host: str) -> bool:
    """Whether a host name or address (no port, no brackets) names this machine only: a loopback IP
    address (127.0.0.0/8, ::1, or 127.x.x.x mapped into IPv6), `localhost` or a name under `.localhost`
    (RFC 6761 keeps those for loopback). A name that merely starts like one (127.0.0.1.example) is not."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def host_of_header(value: str) -> str:
    """The host of an HTTP Host header (`name`, `name:port`, `[v6]`, `[v6]:port`), lower-case."""
    if value.startswith("["):
        return value[1:].partition("]")[0].lower()
    return value.partition(":")[0].lower().rstrip(".")
