"""What the supervisor hands the gateway process at spawn (kept apart so the supervisor loads no HTTP server)."""

from __future__ import annotations

import msgspec


class GatewaySpec(msgspec.Struct, frozen=True):
    """Everything the gateway needs, as msgpack."""

    config: bytes
    devices: list[str]
    control: str
    http_upstream: str  # the supervisor's ipc:// endpoint for requests that came over HTTP
