"""The names inferd gives files in /dev/shm: the daemon's arenas, its gateways' regions and its clients'."""

from __future__ import annotations

import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "inferd-"
# An arena is inferd-PID-...: the pid lets the stale sweep find arenas whose daemon is gone.
ARENA_NAME = re.compile(rf"^{ARENA_PREFIX}(\d+)-")
# A gateway's own region (oip/hop_region.py), inferd-gateway-PID: its name goes once the supervisor has it open.
GATEWAY_REGION_PREFIX = "inferd-gateway-"
CLIENT_PREFIX = "inferd-client-"  # server.client_shm_prefix's default, and the client's
