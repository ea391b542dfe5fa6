"""Clients' shared-memory regions in the supervisor's store (inferd/supervisor/shared/regions.py), on real files
in /dev/shm: a region is read and written only through its descriptor, only by the connection that
registered it, and closed with it. What may be registered is tried against the real daemon
(tests/test_client_shm.py, tests/test_oip_shm.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inferd.errors import InvalidRequest
from inferd.supervisor.shared.regions import Regions
from inferd.system.shm_names import GATEWAY_REGION_PREFIX, SHM_DIR

PREFIX = "inferd-client-"


@pytest.fixture
def shm() -> Iterator[Callable[[int], str]]:
    """Make a region file of n bytes (0, 1, 2, ... mod 256) in /dev/shm; all are removed afterwards."""
    made: list[Path] = []

    def make(size: int, name: str | None = None) -> str:
        key = name or f"{PREFIX}test-{uuid.uuid4().hex[:12]}"
        path = SHM_DIR / key
        path.write_bytes(bytes(i % 256 for i in range(size)))
        made.append(path)
        return key

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_a_region_is_read_into_and_written_from_through_its_descriptor(shm):
    key = shm(4096)
    regions = Regions(PREFIX)
    region = regions.register("conn-a", "in", f"/{key}", offset=1024, size=1024,  # POSIX names start with /
                              describe="connection a")
    target = bytearray(16)
    region.read_into(memoryview(target), 8)
    assert bytes(target) == bytes((1024 + 8 + i) % 256 for i in range(16))
    region.write_from([memoryview(b"ab"), memoryview(b"cd")], 100)
    assert (SHM_DIR / key).read_bytes()[1124:1128] == b"abcd"
    assert regions.status() == [{"name": "in", "key": key, "offset": 1024, "byte_size": 1024,
                                 "owner": "connection a", "requests": 0}]
    with pytest.raises(InvalidRequest, match="bytes 1020 to 1036 of region 'in', which is 1024 bytes"):
        region.read_into(memoryview(target), 1020)
    regions.close()
    with pytest.raises(InvalidRequest, match="region 'in' was unregistered while the request waited"):
        region.read_into(memoryview(target), 0)


def test_a_region_is_its_connections_only_and_closed_with_it(shm):
    regions = Regions(PREFIX)
    region = regions.register("conn-a", "r", shm(64), 0, 64)
    with pytest.raises(InvalidRequest, match="no region 'r' is registered on this connection"):
        regions.get("conn-b", "r")
    assert regions.get("conn-a", "r") is region
    with pytest.raises(InvalidRequest, match="already registered on this connection"):
        regions.register("conn-a", "r", shm(64), 0, 64)
    second = regions.register("conn-a", "s", shm(64), 0, 64)
    assert regions.unregister("conn-a", "r") == 1
    with pytest.raises(OSError):
        os.fstat(region.fd)
    assert regions.unregister("conn-a") == 1, "a connection gone: every region it had"
    with pytest.raises(OSError):
        os.fstat(second.fd)
    assert regions.status() == []


def test_every_region_registered_over_a_connection_goes_when_it_drops(shm):
    regions = Regions(PREFIX)
    over_one = [regions.register(("gateway", peer), "r", shm(64), 0, 64, link="link-1") for peer in ("p", "q")]
    other = regions.register("conn-b", "r", shm(64), 0, 64, link="link-2")
    assert regions.drop_link("link-1") == 2
    assert all(region.closed for region in over_one) and not other.closed
    assert [r["owner"] for r in regions.status()] == ["conn-b"]
    regions.close()


def test_the_descriptors_clients_regions_hold_are_counted_and_a_gateways_own_are_not(shm):
    regions = Regions(PREFIX)
    regions.register("conn-a", "one", shm(64), 0, 64, link="link-1")
    regions.register("conn-a", "two", shm(64), 0, 64, link="link-1")
    regions.register(("gateway", "own"), "hop", shm(64, f"{GATEWAY_REGION_PREFIX}test-{uuid.uuid4().hex[:12]}"), 0,
                     64, link="link-2", prefix=GATEWAY_REGION_PREFIX)
    assert regions.held == 2
    regions.unregister("conn-a", "one")
    assert regions.held == 1
    regions.drop_link("link-1")
    assert regions.held == 0
    regions.close()
    assert regions.held == 0
