"""The daemon's promises under faults, against the real daemon: one frame never takes it down,
memory is bounded by bytes, nothing stays stuck, deadlines and versions are kept exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import models
import msgspec
import numpy as np
import pytest
from conftest import MLP, RELOAD_MLP, Daemon, base_config, exited, gated_reload_repo, until, wait_for
from test_reload import Traffic
from wire import RawPeer

from inferd.harness import free_port
from inferd.ipc.control import ControlClient, ControlError

BIN = Path(sys.executable).parent
X_MLP = np.ones((1, models.MLP_IN), dtype=np.float32)
X2 = np.ones((1, 2), dtype=np.float32)
ONE_AT_A_TIME = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 1, "warmup_batch_sizes": [1]}
DEPTH = 100_000


def inferctl(daemon: Daemon, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, *argv],
                          capture_output=True, text=True, timeout=timeout)


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# -- one frame must never take the daemon down --------------------------------------


@pytest.mark.parametrize("header", [
    b'{"id":1,"model":"mlp","inputs":' + deep(DEPTH) + b"}",
    b'{"id":1,"model":"mlp","x":' + deep(DEPTH) + b',"inputs":[]}',
    deep(DEPTH),
], ids=["deep inputs", "deep unknown field", "deep header"])
def test_a_header_nested_100000_deep_is_invalid_and_the_daemon_serves_on(shared_daemon, header):
    with RawPeer(shared_daemon.endpoint) as peer:
        peer.send_frames([header, X_MLP.tobytes()])
        reply, _ = peer.recv()
        assert reply["status"] == "invalid", reply
        assert peer.nothing_more(0.05)
        peer.send(2, "mlp", [X_MLP])
        assert peer.recv()[0]["status"] == "ok"


def test_a_control_command_nested_deep_or_with_unknown_arguments_gets_a_sentence(shared_daemon):
    with ControlClient(shared_daemon.control, timeout=10) as control:
        reply = control.exchange([b'{"command":"status","args":{"a":' + deep(DEPTH) + b"}}"])
        answer = msgspec.json.decode(reply[0].bytes)
        assert answer["ok"] is False and "malformed command" in answer["error"]
        with pytest.raises(ControlError, match="stats has no argument 'x'; it takes none"):
            control.call("stats", x=1)
        with pytest.raises(ControlError, match="reload has no argument 'versoin'; it takes version, model, "
                                               "allow_signature_change"):
            control.call("reload", versoin="v2")
        with pytest.raises(ControlError, match="reload needs the argument 'version'"):
            control.call("reload")
        # Of another type than it takes, as a JSON client other than inferctl may send: a sentence, and nothing
        # done ("no" would have counted as a confirmation).
        for command, args, sentence in [
            ("reload", {"version": 123}, "reload's argument 'version' is a string, not 123"),
            ("reload", {"version": "v2", "canary": "10"}, "reload's argument 'canary' is a number or null, not '10'"),
            ("rollback", {"confirm": "no"}, "rollback's argument 'confirm' is true or false, not 'no'"),
            ("versions", {"model": ["mlp"]}, "versions's argument 'model' is a string or null, not ['mlp']"),
        ]:
            with pytest.raises(ControlError, match=re.escape(sentence)):
                control.call(command, **args)
        assert control.call("health")["healthy"]


# -- memory bounded by bytes ----------------------------------------------------------


def test_requests_over_the_byte_bounds_are_overloaded_at_once(start_daemon, gates):
    x = np.ones((4, models.SLOW_FEATURES), dtype=np.float32)  # a full batch of `slow`: 1 KiB and a header
    size = len(msgspec.json.encode({"id": 0, "model": "slow",
                                    "inputs": [{"dtype": "float32", "shape": [4, models.SLOW_FEATURES]}]})) + x.nbytes
    # Two may wait per connection, four in all.
    daemon = start_daemon({"slow": {"inputs": [{"dtype": "float32", "shape": [models.SLOW_FEATURES]}],
                                    "max_batch_size": 4, "warmup_batch_sizes": [1]},
                           "variable": ONE_AT_A_TIME},
                          workers={"streams": 1},
                          queue={"max_bytes": 4 * size + 100, "max_bytes_per_client": 2 * size + 50})
    with RawPeer(daemon.endpoint) as first, RawPeer(daemon.endpoint) as second, RawPeer(daemon.endpoint) as third:
        gate = gates()
        first.send("busy", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor busy")
        first.send("next", "slow", [x], timeout_ms=30_000)  # into the executor's pipeline behind it
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the pipeline full")
        for i in range(3):  # from now on everything waits in the queue
            first.send(i, "slow", [x], timeout_ms=30_000)
        over_share = first.recv()[0]
        assert over_share["id"] == 2 and over_share["status"] == "overloaded", over_share
        assert "queue.max_bytes_per_client" in over_share["error"], over_share
        for i in range(2):
            second.send(i, "slow", [x], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["models"]["slow"]["queue_depth"] == 4, what="four waiting")
        third.send("over", "slow", [x], timeout_ms=30_000)
        over_all = third.recv()[0]
        assert over_all["status"] == "overloaded" and "queue.max_bytes" in over_all["error"], over_all
        gate.open()
        answered = [first.recv()[0] for _ in range(4)] + [second.recv()[0] for _ in range(2)]
        assert first.nothing_more() and second.nothing_more() and third.nothing_more()
    assert all(h["status"] == "ok" for h in answered), answered


# -- nothing stuck -----------------------------------------------------------------------


def test_a_reload_whose_warm_up_hangs_ends_at_the_load_timeout_and_the_next_one_works(workdir, reload_repo):
    config = base_config(workdir, reload_repo, {"mlp": RELOAD_MLP},
                         workers={"devices": ["cpu", "cpu"], "load_timeout_s": 2})
    daemon = Daemon(workdir, config).start()
    try:
        hung = daemon.status()["workers"]
        with Traffic(daemon, threads=3) as traffic:
            started = time.monotonic()
            result = inferctl(daemon, "reload", "--version", "hangs")  # no --timeout: it ends anyway
            took = time.monotonic() - started
        assert result.returncode == 1, result.stdout
        assert "did not load mlp hangs within workers.load_timeout_s (2 s)" in result.stderr, result.stderr
        assert "v1 keeps serving" in result.stderr
        assert took < 30
        # The hung workers are replaced one at a time, not left with a loader thread that never returns;
        # the other serves v1 meanwhile.
        with Traffic(daemon, threads=3) as during:
            wait_for(lambda: all(w["generation"] == 2 and w["state"] == "ready" for w in daemon.status()["workers"]),
                     timeout=60, what="both workers replaced")
        assert not [h for _, h, _, _ in traffic.records + during.records if h["status"] != "ok"]
        assert [w["pid"] for w in daemon.status()["workers"]] != [w["pid"] for w in hung]
        result = inferctl(daemon, "reload", "--version", "v2")
        assert result.returncode == 0, result.stderr
        assert daemon.status()["models"]["mlp"]["live_version"] == "v2"
    finally:
        daemon.kill_all()


def test_a_worker_that_dies_during_a_reload_ends_it_with_a_sentence(workdir, reload_repo):
    repo, gate = gated_reload_repo(reload_repo, workdir, "v1", "v2")
    config = base_config(workdir, repo, {"mlp": RELOAD_MLP}, workers={"devices": ["cpu", "cpu"]})
    daemon = Daemon(workdir, config).start()
    try:
        reload = subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "reload", "--version",
                                   "gated"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "loading mlp gated" in reload.stdout.readline()
        victim = daemon.status()["workers"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: exited(victim), what="worker1 gone")
        gate.open()  # worker0's load ends; the reload, which waits for every worker, with it
        _, err = reload.communicate(timeout=120)
        assert reload.returncode == 1
        assert "worker1 died while loading gated" in err and "v1 keeps serving" in err, err
        assert daemon.status()["models"]["mlp"]["live_version"] == "v1"
        daemon.wait_healthy()
        assert inferctl(daemon, "reload", "--version", "v2").returncode == 0
    finally:
        daemon.kill_all()


def test_sigusr1_writes_the_supervisors_stacks_to_the_log_and_the_stacks_file(shared_daemon):
    daemon = shared_daemon
    before = daemon.log().count("SIGUSR1: thread stacks")
    daemon.signal(signal.SIGUSR1)
    stacks = Path(daemon.control[len("ipc://"):] + ".stacks")
    wait_for(lambda: daemon.log().count("SIGUSR1: thread stacks") > before, what="the stacks in the log")
    assert "_loop" in stacks.read_text() and "Current thread" in stacks.read_text()
    assert "_poll" in daemon.log()
    assert daemon.call("health")["healthy"], "SIGUSR1 does not stop the daemon"


def test_stacks_falls_back_to_sigusr1_when_the_control_socket_does_not_answer(shared_daemon):
    daemon = shared_daemon
    # No daemon answers within a microsecond: the command takes the way a stuck daemon needs.
    result = inferctl(daemon, "--timeout", "0.000001", "stacks")
    assert result.returncode == 0, result.stderr
    assert "did not answer" in result.stderr and "SIGUSR1" in result.stderr
    supervisor, _, rest = result.stdout.partition("== worker0")
    assert "== supervisor ==" in supervisor and "_loop" in supervisor
    assert "executor" in rest or "_serve_control" in rest


def test_a_tcp_control_endpoint_without_curve_is_refused_at_start(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server={"control": f"tcp://127.0.0.1:{free_port()}"}, wait=False)
    assert daemon.wait(60) == 1
    assert "is a tcp endpoint without CURVE: anyone who reaches it could reload models" in daemon.log()


# -- promises kept exactly -----------------------------------------------------------------


def test_no_request_is_computed_after_its_deadline_even_behind_a_running_batch(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_AT_A_TIME}, workers={"streams": 1})
    before = daemon.status()["workers"][0]["batches"]
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("long", "variable", [gate.input], timeout_ms=30_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the first batch running")
        # A full batch (max_batch_size 1) goes into the executor's pipeline behind the running one,
        # and its deadline passes while it waits there.
        sent = time.monotonic()
        peer.send("short", "variable", [X2], timeout_ms=1000)
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the short one stacked")
        until(sent + 1.1)
        gate.open()
        replies = {h["id"]: h for h, _ in (peer.recv(), peer.recv())}
    assert replies["long"]["status"] == "ok"
    assert replies["short"]["status"] == "timeout" and "deadline passed" in replies["short"]["error"]
    assert replies["short"]["version"] == "v1", "error replies name the version that handled them"
    assert daemon.status()["workers"][0]["batches"] - before == 1, "the expired request was computed"
    assert daemon.call("stats")["models"]["variable"]["requests"]["timeout"] == 1
    assert "not computed, their deadline passed while the batch waited" in daemon.log()


def test_a_request_for_a_replaced_version_is_never_computed_by_another(workdir, repo):
    # sleepy: ~5 ms a batch of one; 300 requests naming v1 wait behind each other while v2 goes live.
    versions = workdir / "repo"
    for version in ("v1", "v2"):
        (versions / "sleepy" / version).mkdir(parents=True)
        (versions / "sleepy" / version / "model.pt").write_bytes((repo / "sleepy" / "v1" / "model.pt").read_bytes())
    config = base_config(workdir, versions, {"sleepy": {**ONE_AT_A_TIME, "version": "v1"}}, workers={"streams": 1})
    daemon = Daemon(workdir, config).start()
    try:
        with RawPeer(daemon.endpoint) as peer:
            for i in range(300):
                peer.send(i, "sleepy", [X2], version="v1", timeout_ms=60_000)
            first = peer.recv()[0]
            assert daemon.call("reload", timeout=60, version="v2")["version"] == "v2"
            replies = [first] + [peer.recv()[0] for _ in range(299)]
    finally:
        daemon.kill_all()
    ok = [r for r in replies if r["status"] == "ok"]
    refused = [r for r in replies if r["status"] == "unavailable"]
    assert len(ok) + len(refused) == 300
    assert {r["version"] for r in ok} == {"v1"}, "a request that named v1 was computed by another version"
    assert refused, "the test needs requests still queued at the flip"
    assert all("version 'v1' of sleepy was replaced by 'v2' while the request waited" in r["error"] for r in refused)
    assert {r["version"] for r in refused} == {"v2"}


@pytest.mark.parametrize("setting, says", [
    ({"precision": "fp16"}, "mlp has precision 'fp16', which needs a GPU, but this worker runs on cpu"),
    ({"batch_buckets": [1, 8], "cuda_graphs": True},
     "mlp has cuda_graphs = true, which needs a GPU, but this worker runs on cpu; set cuda_graphs = false"),
])
def test_what_needs_a_gpu_is_refused_on_a_cpu_worker(start_daemon, setting, says):
    daemon = start_daemon({"mlp": {**MLP, **setting}}, wait=False)
    assert daemon.wait(60) == 1
    assert says in daemon.log()


def test_one_batch_that_grows_memory_past_the_leak_limit_is_named(start_daemon):
    daemon = start_daemon({"leaky": {**ONE_AT_A_TIME}}, workers={"leak_warn_mb": 50, "streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(2):
            peer.send(i, "leaky", [X2])
            assert peer.recv()[0]["status"] == "ok"
    wait_for(lambda: "of leaky v1 on worker0 grew its memory by" in daemon.log(), what="the per-batch warning")
    line = next(line for line in daemon.log().splitlines() if "grew its memory by" in line)
    assert "batch " in line and "(more than workers.leak_warn_mb = 50)" in line


def test_out_of_memory_in_a_batch_fails_that_batch_and_the_worker_serves_on(start_daemon):
    daemon = start_daemon({"oom": ONE_AT_A_TIME})
    pid = daemon.status()["workers"][0]["pid"]
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "oom", [np.array([[-1, 0]], dtype=np.float32)])
        failed = peer.recv()[0]
        peer.send(2, "oom", [np.array([[1, 2]], dtype=np.float32)])
        served = peer.recv()
    assert failed["status"] == "internal" and failed["version"] == "v1"
    assert re.fullmatch(r"out of memory on cpu for batch \d+ of oom v1, 1 samples", failed["error"]), failed
    assert served[0]["status"] == "ok"
    np.testing.assert_array_equal(served[1][0], [[3, 6]])
    assert daemon.status()["workers"][0]["pid"] == pid, "the worker was not replaced"
