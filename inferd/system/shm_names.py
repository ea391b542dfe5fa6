"""The names inferd gives files in /dev/shm: the daemon's arenas and its clients' regions."""

from __future__ import annotations

import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "inferd-"
# An arena is inferd-PID-...: the pid lets the stale sweep find arenas whose daemon is gone.
ARENA_NAME = re.compile(rf"^{ARENA_PREFIX}(\d+)-")
CLIENT_PREFIX = "inferd-client-"  # server.client_shm_prefix's default, and the client's
