"""What the supervisor hands a gateway process at spawn (kept apart so the supervisor loads no HTTP or
gRPC server)."""

from __future__ import annotations

import msgspec

PROTOCOLS = ("http", "grpc")  # the front ends, each in a gateway process of its own


class GatewaySpec(msgspec.Struct, frozen=True):
    """Everything a gateway needs, as msgpack."""

    protocol: str  # one of PROTOCOLS
    name: str  # the protocol, and which of its processes this is when it has several ("http 2")
    config: bytes
    devices: list[str]
    control: str
    upstream: str  # the supervisor's ipc:// endpoint for the requests of this protocol
