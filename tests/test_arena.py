"""Shared-memory arenas: create, attach from another process, slots, stale sweep."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from inferd.ipc.arena import Arena, ArenaError, arena_name, sweep_stale
from inferd.ipc.slots import SlotPool, align_up
from inferd.system.shm_names import SHM_DIR


@pytest.fixture
def arena():
    # Not `inferd-<pid>-`: the test process is no supervisor, so a daemon another test starts meanwhile
    # would sweep such a name as stale.
    a = Arena.create(f"inferd-test-{os.getpid()}-{time.monotonic_ns()}", 1 << 20)
    yield a
    a.close()
    a.unlink()


def _write_in_child(name: str) -> None:
    child = Arena.attach(name)
    np.ndarray((4,), dtype=np.float32, buffer=child.buf, offset=4096)[:] = [1, 2, 3, 4]
    child.close()


def test_another_process_sees_the_same_memory(arena):
    process = multiprocessing.get_context("spawn").Process(target=_write_in_child, args=(arena.name,))
    process.start()
    process.join(30)
    assert process.exitcode == 0
    np.testing.assert_array_equal(np.frombuffer(arena.buf[4096:4112], dtype=np.float32), [1, 2, 3, 4])
    assert arena.path.exists(), "an attacher must never unlink"


def test_arena_is_owner_only_and_unlink_is_idempotent(arena):
    assert (arena.path.stat().st_mode & 0o777) == 0o600
    arena.unlink()
    arena.unlink()
    assert not arena.path.exists()


def test_attach_to_a_missing_arena_says_so():
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.attach("inferd-0-missing")


def test_create_refuses_when_dev_shm_lacks_room():
    with pytest.raises(ArenaError, match="lower workers.shm_mb"):
        Arena.create(f"inferd-{os.getpid()}-huge", 1 << 60)
    assert not (SHM_DIR / f"inferd-{os.getpid()}-huge").exists()


def test_slots_are_page_aligned_reused_and_never_handed_out_twice():
    pool = SlotPool(10 * 4096 + 100, 4)
    assert pool.slot_size == 2 * 4096
    slots = [pool.acquire() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3] and pool.acquire() is None
    assert [pool.offset(s) for s in range(4)] == [0, 8192, 16384, 24576]
    pool.release(slots[2])
    assert pool.acquire() == slots[2]
    with pytest.raises(ValueError):
        pool.release(7)
    pool.release(0)
    with pytest.raises(ValueError):
        pool.release(0)


def test_align_up():
    assert [align_up(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]


def _sleeper(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_sweep_removes_arenas_of_dead_reused_or_foreign_pids_and_keeps_live_ones(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = _sleeper("inferd", "serve")  # an inferd process, as far as its command line says
    reused = _sleeper("inferd", "serve")
    foreign = _sleeper()
    try:
        time.sleep(0.1)
        files = {
            "dead": tmp_path / arena_name(f"{dead.pid}-abc", 0),
            "live": tmp_path / arena_name(f"{live.pid}-abc", 0),
            "reused": tmp_path / arena_name(f"{reused.pid}-abc", 0),
            "foreign": tmp_path / arena_name(f"{foreign.pid}-abc", 0),
        }
        for path in files.values():
            path.write_bytes(b"x")
        # Made an hour before its "owner" started: that pid was reused.
        hour_ago = time.time() - 3600
        os.utime(files["reused"], (hour_ago, hour_ago))
        # A folder of its own: /dev/shm is shared with the daemons other tests run at the same time.
        removed = sweep_stale(tmp_path)
        assert not files["dead"].exists() and files["dead"].name in removed
        assert not files["reused"].exists() and files["reused"].name in removed
        assert not files["foreign"].exists() and files["foreign"].name in removed
        assert files["live"].exists(), "the arena of a running inferd was swept"
    finally:
        for process in (live, reused, foreign):
            process.kill()
            process.wait()
        for path in files.values():
            path.unlink(missing_ok=True)
