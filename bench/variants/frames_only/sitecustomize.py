"""The gateways without their hop region (inferd/oip/hop_region.py): every request's tensors go to the supervisor
in the frames of its message, as before the region, for bench.gateway_hop to measure one way against the other.

On a daemon's PYTHONPATH this file is imported by every process at start (Python's sitecustomize); with
INFERD_FRAMES_ONLY set, a gateway registers no region.
"""

from __future__ import annotations

import os

from inferd.oip.upstream import Upstream


async def _no_region(self: Upstream) -> None:
    """Leave the gateway without a hop region."""


if os.environ.get("INFERD_FRAMES_ONLY"):
    Upstream.open_hop_region = _no_region  # type: ignore[method-assign]
