"""Daemons started for one test each: overload, deadlines, limits, stop, crash, start-up errors."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import models
import numpy as np
import psutil
import pytest
from conftest import (
    FAILING,
    MLP,
    ONE_AT_A_TIME,
    SLOW,
    Daemon,
    base_config,
    exited,
    replies_across_a_worker_death,
    requests_accounted,
    wait_for,
)
from wire import RawPeer

from inferd import Client, RetryPolicy
from inferd.harness import free_port
from inferd.system.shm_names import SHM_DIR

ONE_SLOW = {**SLOW, "max_batch_size": 1, "warmup_batch_sizes": [1]}
X_SLOW = np.ones((1, models.SLOW_FEATURES), dtype=np.float32)
X_MLP = np.ones((1, models.MLP_IN), dtype=np.float32)


def arenas_of(pid: int) -> list[Path]:
    """Shared-memory arenas a supervisor pid created."""
    return sorted(SHM_DIR.glob(f"inferd-{pid}-*"))


def burst(endpoint: str, model: str, x: np.ndarray, count: int, **header) -> list[dict]:
    """Send `count` requests at once on one socket; return the replies' headers in id order."""
    with RawPeer(endpoint) as peer:
        for i in range(count):
            peer.send(i, model, [x], **header)
        replies = [peer.recv()[0] for _ in range(count)]
        assert peer.nothing_more(), "a request got more than one reply"
    assert sorted(r["id"] for r in replies) == list(range(count)), "a request got no reply"
    return sorted(replies, key=lambda r: r["id"])


def test_overloaded_when_the_queue_is_full_and_only_then(start_daemon):
    daemon = start_daemon({"slow": ONE_SLOW}, queue={"max_size": 2}, workers={"streams": 1})
    replies = burst(daemon.endpoint, "slow", X_SLOW, 40)
    statuses = {r["status"] for r in replies}
    assert statuses == {"ok", "overloaded"}, statuses
    assert all("queue is full" in r["error"] for r in replies if r["status"] == "overloaded")
    # One request at a time never finds the queue full.
    with RawPeer(daemon.endpoint) as peer:
        for i in range(20):
            peer.send(i, "slow", [X_SLOW])
            assert peer.recv()[0]["status"] == "ok"


def test_client_retries_overloaded_until_it_gets_through(start_daemon):
    daemon = start_daemon({"slow": ONE_SLOW}, queue={"max_size": 2}, workers={"streams": 1})
    retry = RetryPolicy(max_attempts=50, initial_delay=0.01, max_delay=0.05, jitter=0.2)
    with Client(daemon.endpoint, timeout=30.0, retry=retry) as client:
        futures = [client.submit("slow", X_SLOW) for _ in range(30)]
        results = [f.result() for f in futures]
    assert len(results) == 30
    assert daemon.status()["replies"]["overloaded"] > 0, "the test never hit a full queue"


def test_requests_whose_deadline_passes_in_the_queue_are_not_computed(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_AT_A_TIME}, workers={"streams": 1})
    before = daemon.status()["workers"][0]["batches"]
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send("held", "variable", [gate.input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the held batch running")
        peer.send("behind", "variable", [x], timeout_ms=60_000)  # into the executor's pipeline, behind it
        wait_for(lambda: daemon.status()["workers"][0]["batches_in_flight"] == 2, what="the second batch sent")
        for index in range(20):  # nowhere to go: they wait in the queue until their deadlines pass
            peer.send(index, "variable", [x], timeout_ms=200)
        expired = [peer.recv()[0] for _ in range(20)]
        gate.open()
        replies = {h["id"]: h for h, _ in (peer.recv(), peer.recv())}
    assert sorted(r["id"] for r in expired) == list(range(20))
    assert all(r["status"] == "timeout" and "the deadline passed before the request ran" in r["error"]
               for r in expired), expired
    assert replies["held"]["status"] == "ok" and replies["behind"]["status"] == "ok", replies
    assert daemon.status()["workers"][0]["batches"] - before == 2, "a request that timed out was computed"


def test_an_oversized_message_is_refused_and_the_daemon_keeps_serving(start_daemon):
    daemon = start_daemon({"mlp": {**MLP, "max_batch_size": 32768, "warmup_batch_sizes": [1]}},
                          server={"max_message_mb": 1}, workers={"shm_mb": 64})
    big = np.zeros((30_000, models.MLP_IN), dtype=np.float32)  # 1.9 MB
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "mlp", [big])
        header, _ = peer.recv()
        assert header["status"] == "invalid"
        assert "over the limit of 1048576 bytes" in header["error"]
        peer.send(2, "mlp", [X_MLP])
        assert peer.recv()[0]["status"] == "ok"


def test_sigterm_finishes_queued_work_and_leaves_nothing_behind(start_daemon, gates):
    daemon = start_daemon({"slow": ONE_SLOW, "variable": ONE_AT_A_TIME}, workers={"streams": 1})
    pid = daemon.process.pid
    workers = [w["pid"] for w in daemon.status()["workers"]]
    assert arenas_of(pid)
    with RawPeer(daemon.endpoint) as peer:
        # A batch held at a gate ahead of the rest, so the drain lasts until the test has seen it.
        gate = gates()
        peer.send(100, "variable", [gate.input])
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the held batch running")
        for i in range(100):
            peer.send(i, "slow", [X_SLOW])
        # What ZeroMQ still holds for the daemon to read is not queued yet; wait until it is.
        wait_for(lambda: requests_accounted(daemon) == 101, what="every request read")
        daemon.signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "draining", what="the drain")
        peer.send(999, "slow", [X_SLOW])
        refused = peer.recv()[0]
        gate.open()
        replies = [peer.recv()[0] for _ in range(101)]
        assert peer.nothing_more()
    by_id = {r["id"]: r for r in replies}
    # Queued before the signal: all computed. After it: refused, not dropped.
    assert [by_id[i]["status"] for i in range(101)] == ["ok"] * 101
    assert refused["id"] == 999 and refused["status"] == "unavailable" and "shutting down" in refused["error"]
    assert daemon.wait() == 0
    assert arenas_of(pid) == []
    assert not Path(daemon.control[len("ipc://"):]).exists()
    assert all(exited(p) for p in workers)
    assert "stopped" in daemon.log()


def test_second_sigterm_answers_what_is_left_unavailable(start_daemon, gates):
    daemon = start_daemon({"slow": {**ONE_SLOW}, "variable": ONE_AT_A_TIME}, workers={"streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        gate = gates()
        peer.send(300, "variable", [gate.input])  # held, so the drain lasts until the second signal
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the held batch running")
        for i in range(300):
            peer.send(i, "slow", [X_SLOW])
        wait_for(lambda: requests_accounted(daemon) == 301, what="every request read")
        daemon.signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "draining", what="the drain")
        daemon.signal(signal.SIGTERM)
        replies = [peer.recv()[0] for _ in range(301)]
        gate.open()  # the held batch, answered already, ends: its worker stops
    statuses = {r["status"] for r in replies}
    assert statuses <= {"ok", "unavailable"} and "unavailable" in statuses, statuses
    assert daemon.wait() == 0
    assert arenas_of(daemon.process.pid) == []


@pytest.mark.parametrize("kill", ["supervisor", "process group"])
def test_a_killed_supervisor_leaves_nothing_behind(start_daemon, kill):
    first = start_daemon({"mlp": MLP})
    pid = first.process.pid
    worker = first.status()["workers"][0]["pid"]
    control = Path(first.control[len("ipc://"):])
    files = [control, *(control.with_name(control.name + suffix) for suffix in (".backend", ".pid", ".stacks"))]
    assert arenas_of(pid) and all(path.exists() for path in files)
    title = [f"inferd: reaper of {pid}"]
    reaper = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:1] == title]
    assert len(reaper) == 1, "the supervisor has its reaper"
    fork_server = psutil.Process(worker).parent()
    assert fork_server.cmdline()[0] == "inferd: fork server" and fork_server.ppid() == pid
    # Its socket's folder, private to this supervisor.
    folder = Path(fork_server.net_connections("unix")[0].laddr).parent
    files.append(folder)
    if kill == "supervisor":
        first.signal(signal.SIGKILL)
    else:
        first.kill_all()  # the supervisor and its workers at once: nobody of them can clean up
    first.wait()
    wait_for(lambda: exited(worker) and exited(fork_server.pid), what="the worker's and the fork server's exit")
    wait_for(lambda: not arenas_of(pid) and not any(path.exists() for path in files),
             what="the reaper's clean-up")
    wait_for(lambda: exited(reaper[0].pid), what="the reaper's exit")
    assert f"supervisor {pid} died; removed" in first.log()
    second = start_daemon({"mlp": MLP})
    with second.client() as client:
        assert client.infer("mlp", X_MLP).shape == (1, models.MLP_OUT)


def test_a_killed_supervisor_leaves_nothing_of_a_python_model_a_sighup_added(start_daemon, python_repo):
    """The reaper, forked at start, removes the arena and stacks file of a step process started since."""
    from python_models import SCALE_CONFIG

    from inferd.harness import to_toml

    daemon = start_daemon({"mlp": MLP})
    pid = daemon.process.pid
    assert len(arenas_of(pid)) == 1
    config = {**daemon.config, "models": {**daemon.config["models"], "scale": {
        **SCALE_CONFIG, "repository": str(python_repo / "scale"), "version": "v1"}}}
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: any(w.get("model") == "scale" and w["state"] == "ready" for w in daemon.status()["workers"]),
             what="the Python model's process ready")
    step = next(w for w in daemon.status()["workers"] if w.get("model") == "scale")
    control = Path(daemon.control[len("ipc://"):])
    stacks = control.with_name(control.name + ".step-scale.0.stacks")
    assert len(arenas_of(pid)) == 2 and stacks.exists()
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    wait_for(lambda: exited(step["pid"]), what="the step's exit")
    wait_for(lambda: not arenas_of(pid) and not stacks.exists(), what="the reaper's clean-up")


def test_a_second_daemon_on_the_same_control_socket_is_refused(start_daemon, workdir, repo):
    first = start_daemon({"mlp": MLP})
    from conftest import Daemon, base_config

    config = base_config(workdir, repo, {"mlp": MLP})
    config["server"]["control"] = first.control
    second_dir = workdir / "second"
    second_dir.mkdir()
    second = Daemon(second_dir, config)
    second.start(wait=False)
    try:
        assert second.wait(60) == 1
        assert f"already running with control socket {first.control}" in second.log()
        assert arenas_of(second.process.pid) == []
    finally:
        second.kill_all()
    assert first.call("health")["healthy"]


def test_a_killed_worker_is_replaced_and_its_batches_computed_again(start_daemon, gates):
    daemon = start_daemon({"variable": ONE_AT_A_TIME, "mlp": MLP}, workers={"streams": 1})
    old = daemon.status()["workers"][0]
    replies = replies_across_a_worker_death(daemon, gates(), signal.SIGKILL)
    assert sorted(r["id"] for r in replies) == list(range(100))
    assert {r["status"] for r in replies} == {"ok"}, [r for r in replies if r["status"] != "ok"]
    assert "died (killed by signal 9" in daemon.log() and "its requests are computed again" in daemon.log()
    daemon.wait_healthy(60)
    new = daemon.status()["workers"][0]
    assert new["pid"] != old["pid"] and new["generation"] == old["generation"] + 1 and new["restarts"] == 1
    with daemon.client() as client:
        assert client.infer("mlp", X_MLP).shape == (1, models.MLP_OUT)


def test_a_model_that_breaks_the_batch_dim_stops_the_start_with_a_clear_error(start_daemon):
    daemon = start_daemon({"wrongbatch": {**FAILING, "warmup_batch_sizes": [1, 4]}}, wait=False)
    assert daemon.wait(90) == 1
    log = daemon.log()
    assert "first dim must be the batch size" in log
    assert "no worker could start" in log
    assert arenas_of(daemon.process.pid) == []


def test_a_missing_version_stops_the_start(start_daemon):
    daemon = start_daemon({"mlp": {**MLP, "version": "v9"}}, wait=False)
    assert daemon.wait(30) == 1
    assert "version 'v9' has no model.py, model.pt or model.pt2" in daemon.log()


def test_arena_too_small_for_a_full_batch_is_a_clear_error(start_daemon):
    daemon = start_daemon({"mlp": {**MLP, "max_batch_size": 40_000, "warmup_batch_sizes": [1]}},
                          workers={"shm_mb": 1}, wait=False)
    assert daemon.wait(90) == 1
    assert "raise workers.shm_mb" in daemon.log()


def test_torch_export_model_is_served(start_daemon, repo):
    import torch

    daemon = start_daemon({"exported": MLP})
    x = np.random.default_rng(5).standard_normal((3, models.MLP_IN), dtype=np.float32)
    with daemon.client() as client:
        y = client.infer("exported", x)
    module = torch.export.load(str(repo / "exported" / "v1" / "model.pt2")).module()
    np.testing.assert_allclose(y, module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_saved_live_version_wins_over_the_config_and_a_record_naming_no_config_is_saved_again_naming_it(
        start_daemon, workdir):
    # As an earlier inferd saved it: no config named. An upgrade changes nothing: this config takes it as its own.
    (workdir / "state").mkdir()
    (workdir / "state" / "live_versions.json").write_text('{"live": {"mlp": "v1"}}')
    daemon = start_daemon({"mlp": {**MLP, "version": "v2"}})
    assert daemon.status()["models"]["mlp"]["live_version"] == "v1"
    saved = json.loads((workdir / "state" / "live_versions.json").read_text())
    assert saved["config"] == str(daemon.config_path) and saved["live"] == {"mlp": "v1"}, saved


def writer_once_read(pipe: Path) -> int | None:
    """The write end of named pipe `pipe`, once a process opens it to read (Linux counts a reader waiting in
    open() for a writer); None before."""
    try:
        return os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["hup", "term"])
def test_a_signal_that_comes_while_the_daemon_reads_its_config_waits_for_the_loop(workdir, repo, signum):
    """Before its loop's handlers are in place (its imports and config take seconds), a SIGHUP or a SIGTERM
    would take its default action: the daemon would end without cleaning up."""
    daemon = Daemon(workdir, base_config(workdir, repo, {"mlp": MLP}))
    text = daemon.config_path.read_text()  # the config is handed to the daemon through a named pipe
    daemon.config_path.unlink()
    os.mkfifo(daemon.config_path)
    try:
        daemon.start(wait=False)
        writer = wait_for(lambda: writer_once_read(daemon.config_path), what="the daemon reading its config")
        daemon.signal(signum)
        with open(writer, "w") as pipe:
            pipe.write(text)
        daemon.config_path.unlink()
        daemon.config_path.write_text(text)  # what a SIGHUP reads again
        if signum == signal.SIGHUP:
            daemon.wait_healthy()
            wait_for(lambda: "SIGHUP: " in daemon.log(), what="the SIGHUP carried out once the daemon serves")
            assert "SIGHUP while starting" in daemon.log()
        else:
            assert daemon.wait() == 0, daemon.log()
            assert "stopping: finishing" in daemon.log()
            assert not arenas_of(daemon.process.pid)
    finally:
        daemon.kill_all()


def test_client_retries_while_the_daemon_is_starting(start_daemon):
    # The client connects before the daemon is up: to a port known in advance, not one it picks.
    daemon = start_daemon({"mlp": MLP}, server={"listen": [f"tcp://127.0.0.1:{free_port()}"]}, wait=False)
    retry = RetryPolicy(max_attempts=200, initial_delay=0.05, max_delay=0.2)
    with Client(daemon.endpoint, timeout=60.0, retry=retry) as client:
        y = client.infer("mlp", X_MLP)
    assert y.shape == (1, models.MLP_OUT)


@pytest.mark.parametrize("endpoint_kind", ["tcp", "ipc"])
def test_client_retries_a_reply_missed_when_the_daemon_restarts(start_daemon, workdir, endpoint_kind):
    listen = None if endpoint_kind == "tcp" else [f"ipc://{workdir}/data.sock"]
    server = {"listen": listen} if listen else {}
    daemon = start_daemon({"slow": ONE_SLOW, "mlp": MLP}, workers={"streams": 1}, server=server)
    retry = RetryPolicy(max_attempts=100, initial_delay=0.1, max_delay=0.5)
    with Client(daemon.endpoint, timeout=90.0, retry=retry) as client:
        futures = [client.submit("slow", X_SLOW) for _ in range(200)]
        wait_for(lambda: any(f.done() for f in futures), what="the first answer")  # killed mid-run
        daemon.kill_all()
        daemon.start(wait=False)
        results = [f.result() for f in futures]
    assert len(results) == 200
