"""Addresses as configs write them: HOST:PORT and tcp://HOST:PORT, IPv6 hosts in brackets."""

from __future__ import annotations


def split(address: str) -> tuple[str, str]:
    """The host (brackets removed) and the port of `HOST:PORT` or `tcp://HOST:PORT`; either may be empty."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def loopback(address: str) -> bool:
    """Whether a tcp:// endpoint or a HOST:PORT address is reachable only from this machine."""
    return loopback_host(split(address)[0])


def loopback_host(host: str) -> bool:
    """Whether a host name or address (no port, no brackets) names this machine only."""
    host = host.lower().rstrip(".")
    return host in ("localhost", "::1") or host.endswith(".localhost") or host.startswith("127.")


def host_of_header(value: str) -> str:
    """The host of an HTTP Host header (`name`, `name:port`, `[v6]`, `[v6]:port`), lower-case."""
    if value.startswith("["):
        return value[1:].partition("]")[0].lower()
    return value.partition(":")[0].lower().rstrip(".")
