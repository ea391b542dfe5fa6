"""The supervisor's open-files limit: each client connection, and each region a client registers, holds a
descriptor.

A shell's soft limit is often 1,024, under a hard limit many times that; the
supervisor raises the soft limit to the hard one as it starts (its children
inherit it), and says what it has. Its clients may not take every descriptor:
out of descriptors, libzmq 4.3.5 aborts the process when a connection comes to
an ipc:// endpoint (inferctl's control socket, a worker or gateway that
restarts), and the daemon could open no arena, file or socket of its own. So
the Budget keeps a reserve, and what the daemon's own work holds, out of the
clients' reach (connections.py turns away a connection past it, client_regions.py
refuses a region).
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("inferd.supervisor")

# The daemon keeps this part of its limit for its own work, and at least RESERVE_LEAST: room for what it
# opens while serving (a reload's arenas and worker connections, inferctl, a gateway's reconnection) and
# for the connections ZeroMQ accepts before the loop hears of them.
RESERVE_PART = 16
RESERVE_LEAST = 64
REMEASURE_S = 1.0  # near the limit, how often what the daemon's own work holds is counted again


def raise_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit, and log the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.info("open files: at most %d (the hard limit)", soft)
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files: at most %d; the hard limit %d could not be taken (%s)", soft, hard, exc)
        return
    log.info("open files: at most %d (raised from %d to the hard limit)", hard, soft)


def open_count() -> int:
    """How many descriptors this process has open."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held


class Budget:
    """How many descriptors the clients may hold: the soft limit, less the reserve, less what the daemon's
    own work holds (counted when the daemon binds its sockets, and again while the clients come near)."""

    def __init__(self) -> None:
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.reserve = max(RESERVE_LEAST, self.limit // RESERVE_PART)
        self.own = 0  # what the daemon's own work holds, as last counted
        self._counted_at = float("-inf")

    @property
    def for_clients(self) -> int:
        """The descriptors clients may hold now."""
        return max(0, self.limit - self.reserve - self.own)

    def count_own(self, held: int, now: float) -> None:
        """Count what the daemon's own work holds: every descriptor open but the `held` ones of clients (as
        it was, when no descriptor is left to count them with)."""
        self._counted_at = now
        try:
            self.own = max(0, open_count() - held)
        except OSError:
            pass

    def recount(self, held: int, now: float) -> None:
        """Count the daemon's own again if clients hold nearly all they may (at most every REMEASURE_S):
        far from the limit its exact size does not matter, and counting takes time in the thousands."""
        if held + self.reserve >= self.for_clients and now - self._counted_at >= REMEASURE_S:
            self.count_own(held, now)

    def describe(self) -> str:
        """What the budget is, for the log."""
        return (f"clients may hold {self.for_clients} of them (the daemon keeps {self.reserve} in reserve and its "
                f"own work holds {self.own})")
