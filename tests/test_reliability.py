"""Nothing lost while a worker dies or comes back, and deadlines kept to the end: a lost batch is computed
again (once), requests wait for a worker expected back, no `ok` leaves after a request's deadline, and a
batch that cannot finish in time for a request is not computed for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import stall
from conftest import exited, held_reload_repo, hold_boots, until, wait_for
from gates import Gate
from wire import RawPeer

from inferd import protocol
from inferd.harness import to_toml
from inferd.protocol import OutputPlace, TensorMeta
from inferd.system.shm_names import SHM_DIR

# `variable` computes about 1.7 us a step (measured here): 3,000 steps are a batch of ~5 ms.
VARIABLE = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}
STEPS_5_MS = 3_000
ONE_BY_ONE = {**VARIABLE, "max_batch_size": 1}
HELD_S = 0.5  # how long the batches that teach the daemon a compute time are held at their gates


def steps(count: int, samples: int = 1) -> np.ndarray:
    return np.full((samples, 2), count, dtype=np.float32)


def batches_computed(daemon) -> int:
    return daemon.call("stats")["workers"][0]["batches"]


def test_a_request_its_batch_cannot_finish_in_time_for_is_answered_timeout_and_not_computed(start_daemon, gates):
    # One executor, one sample a batch. The daemon learns that a batch takes b (>= HELD_S: one held at a gate
    # that long). A and B are held at gates, C waits behind them, and an urgent U comes after C and goes
    # first: once A passes, U is stacked behind B. B is let through when C has HELD_S left, less than the 2 b
    # that U's batch and its own would take, so C is answered then, never computed. Nothing computes on
    # the CPU meanwhile, so a loaded machine changes nothing but the daemon's own reaction time.
    daemon = start_daemon({"variable": ONE_BY_ONE}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        teacher = gates()
        peer.send("teacher", "variable", [teacher.input], timeout_ms=10_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the teacher computing")
        until(time.monotonic() + HELD_S)
        teacher.open()
        assert peer.recv()[0]["status"] == "ok"
        before = batches_computed(daemon)
        a, b = gates(), gates()
        peer.send("A", "variable", [a.input], timeout_ms=30_000)
        peer.send("B", "variable", [b.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="A held, B behind it")
        c_sent, c_timeout_s = time.monotonic(), 2.5  # admitted: expected to end at about 3 b
        peer.send("C", "variable", [steps(10)], timeout_ms=int(c_timeout_s * 1000))
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="C queued")
        peer.send("U", "variable", [steps(10)], timeout_ms=30_000, priority=0)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 2, what="U queued")
        a.open()
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="U stacked behind B")
        until(c_sent + c_timeout_s - HELD_S)
        b.open()
        replies = {header["id"]: header for header, _ in (peer.recv() for _ in range(4))}
    late = replies.pop("C")
    assert late["status"] == "timeout", late
    assert "the request would finish after its deadline" in late["error"] and "it was not computed" in late["error"]
    assert {r["status"] for r in replies.values()} == {"ok"}, replies
    assert batches_computed(daemon) == before + 3, "C's batch was never computed"


def test_a_request_whose_batch_outlasts_its_deadline_is_answered_timeout_at_the_deadline(start_daemon, gates):
    daemon = start_daemon({"variable": VARIABLE}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(10):
            peer.send(i, "variable", [steps(10)], timeout_ms=5_000)
            assert peer.recv()[0]["status"] == "ok"
        # Expected to take well under a millisecond, so it starts; it is held at the gate past its deadline,
        # and the request behind it waits in the executor's pipeline.
        gate = gates()
        sent = time.monotonic()
        peer.send("held", "variable", [gate.input], timeout_ms=300)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the batch computing")
        peer.send("behind", "variable", [steps(10)], timeout_ms=300)
        replies = {header["id"]: (header, outputs) for header, outputs in (peer.recv(), peer.recv())}
        answered = time.monotonic()
        gate.open()
        assert peer.nothing_more(), "what the held batch brought back was dropped"
    assert answered - sent < 2.0, "answered at the deadline, not once the batch was back"
    for header, outputs in replies.values():
        assert header["status"] == "timeout" and not outputs, header
        assert header["error"] == "the deadline passed before its batch finished; the result is dropped", header
    replies = daemon.call("status")["replies"]
    assert replies.get("timeout") == 2 and replies.get("ok") == 10, replies


def test_under_a_flood_with_short_deadlines_no_ok_leaves_after_its_deadline(start_daemon):
    daemon = start_daemon({"variable": VARIABLE})
    count, timeout_ms = 300, 60
    with RawPeer(daemon.endpoint) as peer:
        for i in range(count):
            peer.send(i, "variable", [steps(STEPS_5_MS)], timeout_ms=timeout_ms)
        replies = [peer.recv()[0] for _ in range(count)]
        assert peer.nothing_more()
    assert sorted(r["id"] for r in replies) == list(range(count)), "each request answered exactly once"
    ok = [r for r in replies if r["status"] == "ok"]
    assert ok and {r["status"] for r in replies} <= {"ok", "timeout", "overloaded"}
    late = [r["timing_us"]["total"] for r in ok if r["timing_us"]["total"] > timeout_ms * 1000]
    assert not late, f"{len(late)} ok replies left after their deadline: {late} us"


def kill_worker_in_a_batch(daemon, restarts: int) -> None:
    """SIGKILL the only worker once it is computing (after `restarts` restarts), and wait for its replacement
    to be started."""
    worker = wait_for(lambda: (w := daemon.status()["workers"][0])["state"] == "ready"
                      and w["restarts"] == restarts and w["executors_busy"] and w, timeout=60,
                      what=f"the worker busy after {restarts} restart(s)")
    os.kill(worker["pid"], signal.SIGKILL)
    wait_for(lambda: daemon.status()["workers"][0]["restarts"] == restarts + 1, what="the worker's death seen")


def each_echoed_once(peer: RawPeer, arrays: list[np.ndarray]) -> None:
    """Request i of `variable` (sent with id i, input arrays[i]) answered exactly once, ok, with its input."""
    replies = {}
    for _ in arrays:
        header, outputs = peer.recv(timeout=60)
        replies[header["id"]] = (header, outputs)
    assert peer.nothing_more()
    assert sorted(replies) == list(range(len(arrays))), "each request answered exactly once"
    for i, (header, outputs) in replies.items():
        assert header["status"] == "ok", header
        np.testing.assert_array_equal(outputs[0], arrays[i])  # variable returns its input


def test_a_worker_killed_mid_batch_loses_nothing_and_requests_wait_for_its_return(start_daemon, gates):
    daemon = start_daemon({"variable": VARIABLE}, workers={"streams": 1})
    gate = gates()
    arrays = [gate.input] + [np.array([[10, i]], dtype=np.float32) for i in range(1, 24)]
    with RawPeer(daemon.endpoint) as peer:
        for i, x in enumerate(arrays[:16]):
            peer.send(i, "variable", [x], timeout_ms=30_000)
        kill_worker_in_a_batch(daemon, 0)
        # While it restarts: these wait for it rather than being turned away.
        for i, x in enumerate(arrays[16:], 16):
            peer.send(i, "variable", [x], timeout_ms=30_000)
        gate.open()  # the lost batch, computed again, waits at the gate once more
        each_echoed_once(peer, arrays)
    assert "lost (worker0 died" in daemon.log() and "its requests are computed again" in daemon.log()


def test_a_killed_fork_server_takes_its_workers_along_and_their_replacements_lose_nothing(start_daemon, gates):
    daemon = start_daemon({"variable": VARIABLE}, workers={"streams": 1, "devices": ["cpu", "cpu"]})
    workers = [psutil.Process(w["pid"]) for w in daemon.status()["workers"]]
    server = workers[0].parent()
    assert server.cmdline()[0] == "inferd: fork server" and server.ppid() == daemon.process.pid
    assert workers[1].ppid() == server.pid, "every worker forked from the one fork server"
    gate = gates()
    arrays = [gate.input] + [np.array([[10, i]], dtype=np.float32) for i in range(1, 12)]
    with RawPeer(daemon.endpoint) as peer:
        peer.send(0, "variable", [arrays[0]], timeout_ms=60_000)
        wait_for(lambda: any(w["executors_busy"] for w in daemon.status()["workers"]), what="the held batch running")
        server.kill()
        # The kernel kills its workers with it: none is left serving beside the replacements.
        wait_for(lambda: all(exited(p.pid) for p in [server, *workers]), what="the fork server and its workers gone")
        for i, x in enumerate(arrays[1:], 1):
            peer.send(i, "variable", [x], timeout_ms=60_000)
        gate.open(timeout=60)  # the lost batch, computed again by a replacement
        each_echoed_once(peer, arrays)
    replacements = [psutil.Process(w["pid"]) for w in daemon.status()["workers"]]
    assert {p.ppid() for p in replacements} == {replacements[0].parent().pid} != {server.pid}
    assert replacements[0].parent().cmdline()[0] == "inferd: fork server"


def test_a_request_that_cannot_wait_for_the_return_is_unavailable_saying_when_it_is_expected(start_daemon, gates):
    daemon = start_daemon({"variable": VARIABLE}, workers={"streams": 1})
    gate = gates()
    with RawPeer(daemon.endpoint) as peer:
        peer.send(0, "variable", [gate.input], timeout_ms=30_000)
        kill_worker_in_a_batch(daemon, 0)
        peer.send(1, "variable", [steps(10)], timeout_ms=1)
        header, _ = peer.recv()
        assert header["id"] == 1 and header["status"] == "unavailable", header
        assert re.search(r"no worker serves variable v1 now, and none will before the request's deadline: worker0 "
                         r"is expected back in [0-9.]+ s \(its restart's wait, then its last start's [0-9.]+ s\)",
                         header["error"]), header
        gate.open()
        header, _ = peer.recv(timeout=60)
        assert header["id"] == 0 and header["status"] == "ok", "the lost batch was computed again"


def test_a_batch_that_kills_two_workers_is_answered_internal_and_never_tried_a_third_time(start_daemon, gates):
    daemon = start_daemon({"variable": VARIABLE}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        peer.send("poison", "variable", [gates().input], timeout_ms=60_000)
        kill_worker_in_a_batch(daemon, 0)
        kill_worker_in_a_batch(daemon, 1)
        header, _ = peer.recv(timeout=60)
        assert header["id"] == "poison" and header["status"] == "internal", header
        assert header["error"].startswith("its batch killed two workers (worker0, worker0); it is not tried a third "
                                          "time: worker0 died"), header
        peer.send("after", "variable", [steps(10)], timeout_ms=30_000)
        assert peer.recv(timeout=60)[0]["status"] == "ok"
    assert "killed a second worker" in daemon.log() and "requests poison are answered internal" in daemon.log()
    assert daemon.status()["workers"][0]["restarts"] == 2


def test_a_model_that_is_not_pure_turns_the_retry_off(start_daemon, gates):
    daemon = start_daemon({"variable": {**VARIABLE, "retry_lost_batches": False}}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        peer.send(0, "variable", [gates().input], timeout_ms=60_000)
        kill_worker_in_a_batch(daemon, 0)
        header, _ = peer.recv(timeout=60)
    assert header["status"] == "internal" and "worker0 died" in header["error"], header


def test_a_worker_that_wedges_while_idle_is_found_by_a_ping_and_replaced(start_daemon):
    daemon = start_daemon({"variable": VARIABLE}, workers={"batch_timeout_s": 1})
    # Idle and well, it answers the pings (and is left alone).
    wait_for(lambda: daemon.status()["workers"][0]["ping_ms"] is not None, what="a ping answered")
    old = daemon.status()["workers"][0]
    os.kill(old["pid"], signal.SIGSTOP)  # wedged: its main thread answers nothing
    wait_for(lambda: (w := daemon.status()["workers"][0])["restarts"] == 1 and w["state"] == "ready",
             timeout=60, what="the wedged worker replaced")
    assert "worker0 did not answer a ping within 1 s while idle (workers.batch_timeout_s)" in daemon.log()
    assert old["restarts"] == 0, "a worker that answers is not aborted"
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "variable", [steps(10)], timeout_ms=10_000)
        assert peer.recv()[0]["status"] == "ok"


def replacement_held(daemon, restarts: int, hold: Path) -> Gate:
    """SIGKILL the only worker (serving held_reload_repo's v1): its replacement waits at a gate while it boots,
    so that no worker serves until the test opens it."""
    gate = hold_boots(hold)
    os.kill(daemon.status()["workers"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["workers"][0])["restarts"] == restarts and w["state"] == "booting",
             what="the replacement booting")
    return gate


def test_a_reload_asked_for_while_the_only_worker_restarts_waits_for_it(reload_daemon, reload_repo, workdir):
    repo, hold = held_reload_repo(reload_repo, workdir, "v2")
    daemon = reload_daemon(repo=repo, workers={"load_timeout_s": 2})
    inferctl = [str(Path(sys.executable).parent / "inferctl"), "--control", daemon.control, "reload", "--version", "v2"]
    held = replacement_held(daemon, 1, hold)
    try:  # it does not come back within workers.load_timeout_s: the reload ends, saying so
        refused = subprocess.run(inferctl, capture_output=True, text=True, timeout=60)
    finally:
        held.open()
    assert refused.returncode == 1 and "no worker serving v1 came back within workers.load_timeout_s (2 s)" in \
        refused.stderr, refused.stderr
    wait_for(lambda: daemon.status()["workers"][0]["state"] == "ready", what="the replacement ready")
    # Now time enough for the replacement's boot however loaded the machine: the reload waits for it.
    daemon.config["workers"]["load_timeout_s"] = 120
    daemon.config_path.write_text(to_toml(daemon.config))
    applied = daemon.log().count("SIGHUP: applied")
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: daemon.log().count("SIGHUP: applied") > applied, what="the SIGHUP applied")
    held = replacement_held(daemon, 2, hold)
    waiting = subprocess.Popen(inferctl, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout is not None
        first = waiting.stdout.readline()
        assert "no worker serves mlp now: waiting for worker0, expected back in" in first and "to load v2" in first
    finally:
        held.open()
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert out.strip().splitlines()[-1].startswith("mlp v2 is live (was v1)"), out
    assert daemon.status()["workers"][0]["loaded"] == ["mlp v2"]


def test_reloads_and_sighups_leak_no_descriptors_or_threads(reload_daemon):
    daemon = reload_daemon()

    def counts() -> dict[str, tuple[int, int]]:
        status = daemon.status()
        pids = {"supervisor": status["pid"], **{f"worker{w['worker']}": w["pid"] for w in status["workers"]}}
        return {name: (psutil.Process(pid).num_fds(), psutil.Process(pid).num_threads()) for name, pid in pids.items()}

    def cycle(times: int) -> None:
        for index in range(times):
            assert daemon.call("reload", timeout=60, version=("v2", "v1")[index % 2])["version"]
            daemon.signal(signal.SIGHUP)
            wait_for(lambda n=index: daemon.log().count("SIGHUP: applied") > handled + n, what="the SIGHUP handled")

    handled = daemon.log().count("SIGHUP: applied")
    cycle(2)  # whatever is made once, on first use, is made now
    handled = daemon.log().count("SIGHUP: applied")
    before = counts()
    cycle(20)
    after = wait_for(lambda: (now := counts()) == before and now, timeout=30,
                     what=f"descriptors and threads back to {before} (now {counts()})")
    assert after == before


# -- from the anchors' security advisories ------------------------------------------------------------


@pytest.mark.parametrize("change", ["unregistered", "truncated"])
def test_a_region_changed_under_waiting_requests_fails_only_them_once_each(start_daemon, gates, change):
    # Triton's CVE-2024-0116: a region unregistered or cut short while requests that read it or write
    # into it wait. One executor is busy; behind it one batch is stacked and the rest queue.
    daemon = start_daemon({"variable": ONE_BY_ONE}, workers={"streams": 1},
                          server={"allow_client_shm": True, "client_shm_prefix": "inferd-client-"})
    path = SHM_DIR / f"inferd-client-{uuid.uuid4().hex[:12]}"
    path.write_bytes(np.arange(512, dtype=np.float32).tobytes())
    try:
        with RawPeer(daemon.endpoint) as peer:
            peer.send_frames([protocol.encode_op(protocol.RegisterRegion(id="reg", name="r", key=path.name,
                                                                         byte_size=2048))])
            assert peer.recv()[0]["status"] == "ok"
            gate = gates()
            peer.send("blocker", "variable", [gate.input], timeout_ms=60_000)
            wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
            sent = {}
            for index in range(6):
                name = f"in-{index}"
                peer.send_frames(protocol.encode_request(name, "variable", [TensorMeta("float32", (1, 2), "r",
                                                                                        8 * index)]))
                sent[name] = "input"
                name = f"out-{index}"
                peer.send_frames(protocol.encode_request(name, "variable", [steps(10)],
                                                         outputs=(OutputPlace("r", 1024 + 8 * index),)))
                sent[name] = "output"
            wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] >= 10, what="the requests queued")
            replies = {}
            if change == "unregistered":
                peer.send_frames([protocol.encode_op(protocol.UnregisterRegion(id="unreg", name="r"))])
                # Only the unregistration can be answered while the executor is held: the change is
                # in force before anything behind the blocker moves.
                header, _ = peer.recv(timeout=60)
                assert (header["id"], header["status"]) == ("unreg", "ok"), header
            else:
                os.truncate(path, 4)
            gate.open()
            for _ in range(len(sent) + 1):
                header, _ = peer.recv(timeout=60)
                replies[header["id"]] = header
            assert peer.nothing_more(), "one reply each"
        assert replies["blocker"]["status"] == "ok"
        assert set(replies) >= set(sent), "every request answered"
        for name in sent:
            status, error = replies[name]["status"], replies[name].get("error", "")
            # Stacked before the change, a request may have been read (or will write) in time; else refused.
            assert status in ("ok", "invalid"), replies[name]
            if status == "invalid":
                assert "region 'r'" in error, error
        assert any(replies[name]["status"] == "invalid" for name in sent), "the change was seen"
        assert daemon.status()["workers"][0]["restarts"] == 0 and daemon.status()["state"] == "serving"
        with RawPeer(daemon.endpoint) as peer:
            peer.send("after", "variable", [steps(10)], timeout_ms=10_000)
            assert peer.recv()[0]["status"] == "ok"
    finally:
        path.unlink(missing_ok=True)


def test_a_cancel_in_every_state_of_a_request_gets_each_exactly_one_reply(start_daemon, gates):
    # Triton's CVE-2025-23322: a cancel of a request that is running, stacked behind it, queued, or
    # already answered.
    daemon = start_daemon({"variable": ONE_BY_ONE}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        peer.send("replied", "variable", [steps(10)], timeout_ms=10_000)
        assert peer.recv()[0]["status"] == "ok"
        gate = gates()
        peer.send("running", "variable", [gate.input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        peer.send("stacked", "variable", [steps(10)], timeout_ms=60_000)
        peer.send("queued", "variable", [steps(10)], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="one request queued")
        for name in ("replied", "queued", "stacked", "running", "running", "never-sent"):
            peer.send_frames([protocol.encode_op(protocol.Cancel(id=name))])
        early = peer.barrier()  # every cancel read while "running" is held
        gate.open()
        replies = {}
        for header, _ in early + [peer.recv(timeout=60) for _ in range(3 - len(early))]:
            assert header["id"] not in replies, f"{header['id']} answered twice"
            replies[header["id"]] = header
        assert peer.nothing_more(), "a cancel has no reply, and nothing is answered twice"
    assert {name: r["status"] for name, r in replies.items()} == {
        "queued": "cancelled", "stacked": "cancelled", "running": "cancelled"}, replies
    with RawPeer(daemon.endpoint) as peer:
        peer.send("after", "variable", [steps(10)], timeout_ms=10_000)
        assert peer.recv()[0]["status"] == "ok"
    assert daemon.status()["workers"][0]["restarts"] == 0


def test_when_the_last_worker_is_given_up_waiting_requests_are_answered_unavailable(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_BY_ONE}, workers={"streams": 1, "max_restarts": 0})
    with RawPeer(daemon.endpoint) as peer:
        peer.send("running", "variable", [gates().input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        for name in ("stacked", "queued"):
            peer.send(name, "variable", [steps(10)], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] == 1, what="one request queued")
        os.kill(daemon.status()["workers"][0]["pid"], signal.SIGKILL)
        replies = {header["id"]: header for header, _ in (peer.recv(timeout=30) for _ in range(3))}
        peer.send("later", "variable", [steps(10)], timeout_ms=60_000)
        later = peer.recv(timeout=30)[0]
    assert {name: r["status"] for name, r in replies.items()} == dict.fromkeys(("running", "stacked", "queued"),
                                                                               "unavailable"), replies
    assert all("every worker was given up" in r["error"] for r in replies.values())
    assert later["status"] == "unavailable" and "none is coming back: every worker was given up" in later["error"]
    assert daemon.status()["workers"][0]["state"] == "failed"


# -- memory bounded by bytes -------------------------------------------------------------------------------

MIB = 1 << 20


def resident(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (VmRSS) or at its peak since the last reset (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def test_a_flood_of_large_requests_grows_the_supervisor_by_about_the_queues_byte_bound(start_daemon, gates):
    # 96 requests of 4 MiB at once, from 8 connections, against queue.max_bytes = 64 MiB while the executor is
    # held: a few wait, the rest are refused. At its peak the supervisor holds the queue's 64 MiB and what it
    # reads before it refuses, not a share of the 384 MiB offered; and it gives the freed buffers back.
    budget, floats = 64 * MIB, MIB
    daemon = start_daemon({"sum": {"inputs": [{"dtype": "float32", "shape": [floats]}], "max_batch_size": 1,
                                   "warmup_batch_sizes": [1]}, "variable": ONE_BY_ONE},
                          workers={"streams": 1, "shm_mb": 32}, server={"max_message_mb": 5},
                          queue={"max_bytes": budget, "max_bytes_per_client": budget})
    x = np.full((1, floats), 0.5, dtype=np.float32)
    pid = daemon.process.pid
    peers = [RawPeer(daemon.endpoint) for _ in range(8)]
    try:
        for peer in peers:  # every connection up, and the supervisor past what it makes once
            peer.send("warm", "sum", [x], timeout_ms=30_000)
            assert peer.recv()[0]["status"] == "ok"
        gate = gates()
        peers[0].send("held", "variable", [gate.input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor held")
        before = resident(pid)
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from now
        for k, peer in enumerate(peers):
            for i in range(12):
                peer.send(f"{k}-{i}", "sum", [x], timeout_ms=60_000)

        def read_all() -> bool:
            status = daemon.status()
            waiting = status["models"]["sum"]["queue_depth"] + status["workers"][0]["requests_in_flight"] - 1
            return status["replies"].get("overloaded", 0) + waiting == 96

        wait_for(read_all, what="all 96 requests read")
        peak = resident(pid, "VmHWM")
        # Every request read: the refused ones are freed, and within a tick handed back to the system; what stays
        # is the queue's budget.
        held = wait_for(lambda: (now := resident(pid)) <= before + budget + 16 * MIB and now, timeout=10,
                        what=f"the supervisor down to the queue's budget once every request was read (resident "
                             f"{resident(pid) / MIB:.0f} MiB, {before / MIB:.0f} MiB before the flood)")
        gate.open()
        replies = [peer.recv(timeout=60)[0] for peer in peers for _ in range(12)] + [peers[0].recv()[0]]
    finally:
        for peer in peers:
            peer.close()
    statuses = [r["status"] for r in replies]
    assert set(statuses) == {"ok", "overloaded"} and statuses.count("overloaded") >= 70, statuses
    assert all("queue.max_bytes" in r["error"] for r in replies if r["status"] == "overloaded")
    assert held <= before + budget + 16 * MIB
    # At its peak it also held what ZeroMQ's I/O thread had received that the loop had not read yet: a few requests
    # per connection on a quiet machine, more when the loop is slowed, never more than each connection's receive
    # budget (a quarter of the queue's) and one request (docs/operations/memory.md).
    bound = budget + 8 * (budget // 4 + 4 * MIB) + 16 * MIB
    assert peak - before <= bound, f"the supervisor grew {(peak - before) / MIB:.0f} MiB"
    after = wait_for(lambda: (now := resident(pid)) <= before + 8 * MIB and now, timeout=10,
                     what=f"the freed requests' memory given back (resident {resident(pid) / MIB:.0f} MiB, "
                          f"{before / MIB:.0f} MiB before the flood)")
    assert after <= before + 8 * MIB



def kernel_backlog(port: int) -> int:
    """Bytes the kernel holds that the process at the local end of the tcp connections on `port` has not read."""
    backlog = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # established
            backlog += int(fields[4].split(":")[1], 16)
    return backlog


def test_one_connection_flooding_large_requests_holds_the_supervisor_to_half_the_queues_bound_more(start_daemon, gates):
    # 96 requests of 4 MiB at once on ONE connection against queue.max_bytes = 64 MiB, the executor held, while the
    # supervisor's loop is stopped, as on a machine too busy to run it: ZeroMQ's I/O thread receives what its
    # receive mark lets it. Sampled every 50 ms until every request is answered or waits, the supervisor grows by
    # at most the queue's bound, half of it again, and 16 MiB: what ZeroMQ holds for one connection is bounded in
    # bytes, not 64 messages of any size (docs/operations/memory.md).
    budget, floats = 64 * MIB, MIB
    daemon = start_daemon({"sum": {"inputs": [{"dtype": "float32", "shape": [floats]}], "max_batch_size": 1,
                                   "warmup_batch_sizes": [1]}, "variable": ONE_BY_ONE},
                          workers={"streams": 1, "shm_mb": 32}, queue={"max_bytes": budget})
    x = np.full((1, floats), 0.5, dtype=np.float32)
    supervisor = psutil.Process(daemon.process.pid)
    port = int(daemon.endpoint.rsplit(":", 1)[1])
    replies: list[dict] = []
    with RawPeer(daemon.endpoint) as peer:
        peer.send("warm", "sum", [x], timeout_ms=30_000)
        assert peer.recv()[0]["status"] == "ok"
        gate = gates()
        peer.send("held", "variable", [gate.input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor held")
        before = supervisor.memory_info().rss
        samples: list[int] = []
        sampled = threading.Event()

        def sample() -> None:
            while not sampled.wait(0.05):
                samples.append(supervisor.memory_info().rss)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            header = [msgspec.json.encode({"id": i, "model": "sum", "timeout_ms": 60_000,
                                           "inputs": [{"dtype": "float32", "shape": [1, floats]}]})
                      for i in range(96)]
            data = x.tobytes()
            looked: list[tuple[int, int]] = []

            def stopped_receiving() -> bool:
                # The connection's bytes wait in the kernel, unchanged over a look, while nothing more is held.
                looked.append((kernel_backlog(port), supervisor.memory_info().rss))
                return len(looked) > 1 and looked[-1][0] > 0 and looked[-1] == looked[-2]

            with stall.stopped(daemon.process.pid):  # the supervisor's main thread: its loop
                for frame in header:
                    peer.socket.send_multipart([frame, data], copy=False)
                wait_for(stopped_receiving, timeout=60, every=0.1, what="ZeroMQ to stop receiving")

            def answered_or_waiting() -> bool:
                while not peer.nothing_more(0):
                    replies.append(peer.recv()[0])
                status = daemon.status()  # the held request, and a batch sent to the worker behind it, run
                running = status["workers"][0]["requests_in_flight"] - 1
                return len(replies) + status["models"]["sum"]["queue_depth"] + running == 96

            wait_for(answered_or_waiting, timeout=60, what="every request answered or waiting")
        finally:
            sampled.set()
            sampler.join()
        gate.open()
        replies += [peer.recv(timeout=60)[0] for _ in range(96 - len(replies) + 1)]
    statuses = [r["status"] for r in replies if r["id"] != "held"]
    assert len(statuses) == 96 and set(statuses) == {"ok", "overloaded"}, statuses
    peak = max(samples) - before
    assert peak <= 1.5 * budget + 16 * MIB, (f"the supervisor grew {peak / MIB:.0f} MiB at its peak (samples "
                                              f"{[round((s - before) / MIB) for s in samples]} MiB)")


def test_a_sighup_that_would_change_the_receive_mark_says_it_stays_until_a_restart(start_daemon):
    # 4 MiB requests: 16 MiB of receive budget (a quarter of queue.max_bytes) holds 3; 1 GiB would hold 15. The
    # connections keep the mark they were accepted with (docs/operations/memory.md), and the log says so.
    daemon = start_daemon({"sum": {"inputs": [{"dtype": "float32", "shape": [MIB]}], "max_batch_size": 1,
                                   "warmup_batch_sizes": [1]}}, workers={"shm_mb": 32}, queue={"max_bytes": 64 * MIB})
    config = dict(daemon.config)
    config["queue"]["max_bytes"] = 1 << 30
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP: applied" in daemon.log(), what="the SIGHUP applied")
    assert ("ZeroMQ's receive high-water mark stays 3 messages per connection until a restart; the queue's bounds "
            "and the models now give 15") in daemon.log()
