"""The gateways' hop region (inferd/oip/hop_region.py) turned off, or taken from a smaller size, for
bench.gateway_hop to measure the region against the frames of a request's message at sizes it would not take.

On a daemon's PYTHONPATH this file is imported by every process at start (Python's sitecustomize). With
INFERD_FRAMES_ONLY set, a gateway registers no region: every request's tensors go to the supervisor in frames.
With INFERD_HOP_MIN_KIB, requests from that many KiB go through the region (hop_region.MIN_BYTES).
"""

from __future__ import annotations

import os

from inferd.oip import hop_region
from inferd.oip.upstream import Upstream


async def _no_region(self: Upstream) -> None:
    """Leave the gateway's connection without a hop region."""


if os.environ.get("INFERD_FRAMES_ONLY"):
    Upstream._open_hop_region = _no_region  # type: ignore[method-assign]
if os.environ.get("INFERD_HOP_MIN_KIB"):
    hop_region.MIN_BYTES = int(os.environ["INFERD_HOP_MIN_KIB"]) << 10
