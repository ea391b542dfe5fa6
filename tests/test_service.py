"""The daemon as a systemd service: the unit files, the watchdog, status lines, drain, SIGHUP."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MLP, Daemon, base_config, requests_accounted, wait_for
from test_notify import FakeSystemd
from test_reload import inferctl
from wire import RawPeer

from inferd.harness import SERVE, to_toml
from inferd.system.shm_names import SHM_DIR

ROOT = Path(__file__).parent.parent
SLEEPY = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 8, "warmup_batch_sizes": [1]}
X2 = np.ones((1, 2), dtype=np.float32)


@pytest.fixture
def service(workdir, repo):
    """Start a daemon under a fake systemd with a 2 s watchdog; both are cleaned up after the test."""
    started = []

    def start(models: dict, *options: str, **sections) -> tuple[Daemon, FakeSystemd]:
        """The daemon serving `models`, with `options` on its `inferd serve` command line."""
        systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
        daemon = Daemon(workdir, base_config(workdir, repo, models, **sections), command=(*SERVE, *options))
        daemon.env = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "2000000"}
        started.append((daemon, systemd))
        daemon.start(wait=False)
        systemd.wait_for("READY=1")
        daemon.wait_healthy()  # and learn the port it picked
        return daemon, systemd

    yield start
    for daemon, systemd in started:
        daemon.kill_all()
        systemd.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", ["inferd.service", "inferd@.service"])
def test_systemd_analyze_verify_passes(tmp_path, unit):
    # verify checks that ExecStart= exists: point it at the inferd this test runs.
    inferd = shutil.which("inferd") or str(Path(__import__("sys").executable).parent / "inferd")
    text = (ROOT / "systemd" / unit).read_text().replace("/usr/local/bin/inferd", inferd)
    path = tmp_path / unit
    path.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "inferd" not in result.stderr, result.stderr


def test_ready_means_a_request_succeeds_and_the_watchdog_pings_every_second(service):
    daemon, systemd = service({"mlp": MLP})
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "mlp", [np.zeros((1, 16), dtype=np.float32)])
        assert peer.recv()[0]["status"] == "ok"
    systemd.drain()
    systemd.messages.clear()
    started = time.monotonic()
    pings = []
    while time.monotonic() - started < 3.5:
        systemd.wait_for("WATCHDOG=1", timeout=1.2)
        pings.append(time.monotonic())
    gaps = np.diff(pings)
    assert len(pings) >= 3 and gaps.max() <= 1.2, gaps
    status = [m for m in systemd.messages if m.startswith("STATUS=")]
    assert status and "serving; 1/1 workers ready; mlp v2" in status[-1]


def test_a_stuck_batch_pauses_the_watchdog_until_its_worker_is_replaced(service):
    daemon, systemd = service({"variable": {**SLEEPY, "max_batch_size": 1}}, workers={"batch_timeout_s": 0.2,
                                                                                     "streams": 1})
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "variable", [np.array([[1e8, 0]], dtype=np.float32)])  # minutes: only the check ends it
        reply = peer.recv()[0]
    assert reply["status"] == "internal" and "ran longer than workers.batch_timeout_s" in reply["error"]
    received = systemd.drain()
    assert any("HUNG: batch 1 of variable" in m for m in received), received
    log = daemon.log()
    assert log.index("watchdog pings stop") < log.index("watchdog pings resume")
    systemd.messages.clear()
    systemd.wait_for("WATCHDOG=1", timeout=3)
    daemon.wait_healthy(60)


def test_sigterm_with_200_requests_in_flight_answers_them_all(service):
    daemon, systemd = service({"sleepy": SLEEPY})
    pid = daemon.process.pid
    with RawPeer(daemon.endpoint) as peer:
        for i in range(200):
            peer.send(i, "sleepy", [X2])
        wait_for(lambda: requests_accounted(daemon) == 200, what="every request read")
        daemon.signal(signal.SIGTERM)
        replies = [peer.recv()[0] for _ in range(200)]
    assert [r["status"] for r in replies] == ["ok"] * 200
    systemd.wait_for("STOPPING=1")
    assert daemon.wait() == 0
    assert not list(SHM_DIR.glob(f"inferd-{pid}-*"))


def queue_ms_behind_a_long_batch(daemon: Daemon) -> float:
    """How long a request waits in the daemon's queue when it arrives while a long batch runs."""
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "stuck", [X2])
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the long batch running")
        peer.send(2, "stuck", [X2])
        replies = {h["id"]: h for h in (peer.recv()[0], peer.recv()[0])}
    assert replies[1]["status"] == replies[2]["status"] == "ok"
    return replies[2]["timing_us"]["queue"] / 1000


def test_a_sighup_keeps_the_log_level_of_the_command_line(service):
    # The file says info (the default), the command line warning: a SIGHUP that finds the file unchanged once
    # brought info back, to the supervisor and to its workers (whose logs of a reload then showed).
    daemon, systemd = service({"mlp": MLP}, "--log-level", "warning")
    before = len(daemon.log())
    daemon.signal(signal.SIGHUP)
    systemd.wait_for("RELOADING=1")
    systemd.wait_for("READY=1")
    reload = inferctl(daemon, "reload", "--version", "v1")
    assert reload.returncode == 0, reload.stderr
    assert " INFO " not in daemon.log()[before:], daemon.log()[before:]


def test_sighup_applies_batching_knobs_live_and_names_what_needs_a_restart(service):
    daemon, systemd = service({"stuck": {**SLEEPY, "max_wait_ms": 0}}, workers={"streams": 1})
    # max_wait_ms 0: the second request is queued behind the running batch at once.
    assert queue_ms_behind_a_long_batch(daemon) < 50
    config = daemon.config
    config["models"]["stuck"]["max_wait_ms"] = 5000
    config["queue"]["max_size"] = 77
    config["workers"]["streams"] = 3
    daemon.config_path.write_text(to_toml(config))
    pid = daemon.process.pid
    daemon.signal(signal.SIGHUP)
    systemd.wait_for("RELOADING=1")
    systemd.wait_for("READY=1")
    status = daemon.status()
    assert status["pid"] == pid and status["models"]["stuck"]["max_wait_ms"] == 5000
    # max_wait_ms 5000: it waits in the queue, for company, until the executor is free.
    assert queue_ms_behind_a_long_batch(daemon) > 150
    log = daemon.log()
    assert "SIGHUP: applied queue.max_size 1024 -> 77; models.stuck.max_wait_ms 0 -> 5000" in log
    assert "need a restart and were not applied: workers.streams 1 -> 3" in log


def test_sighup_adds_a_model_and_reloads_a_changed_version(service, repo):
    daemon, systemd = service({"mlp": {**MLP, "version": "v1"}})
    config = daemon.config
    config["models"]["mlp"]["version"] = "v2"
    config["models"]["sleepy"] = {"repository": str(repo / "sleepy"), **SLEEPY}
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)

    def applied() -> bool:
        status = daemon.status()
        return bool(status["models"].get("sleepy") and status["models"]["mlp"]["live_version"] == "v2"
                    and "sleepy v1" in status["workers"][0]["loaded"])

    wait_for(applied, timeout=60, what="the new model and the new version")
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "sleepy", [X2])
        assert peer.recv()[0]["status"] == "ok"
        peer.send(2, "mlp", [np.zeros((1, 16), dtype=np.float32)])
        assert peer.recv()[0]["version"] == "v2"


def test_sighup_with_a_broken_config_changes_nothing(service):
    daemon, systemd = service({"mlp": {**MLP, "version": "v1"}})
    config = daemon.config
    daemon.config_path.write_text("[server\n")
    daemon.signal(signal.SIGHUP)
    systemd.wait_for("READY=1")
    assert "is not valid TOML" in daemon.log() and "nothing changed" in daemon.log()
    assert daemon.call("health")["healthy"]
    # Valid TOML that check-config refuses (a version not copied yet) changes nothing either, not the rest of it.
    levels = daemon.call("models", model="mlp")["mlp"]["priority_levels"]
    config["models"]["mlp"]["version"] = "v9"
    config.setdefault("queue", {})["priority_levels"] = levels + 3
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    systemd.wait_for("READY=1")
    assert "version 'v9' has no model.py, model.pt or model.pt2" in daemon.log()
    assert daemon.call("models", model="mlp")["mlp"]["priority_levels"] == levels
    assert daemon.status()["models"]["mlp"]["config_version"] == "v1"
