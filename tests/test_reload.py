"""Blue-green reload, rollback and versions against the real daemon, under load."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import models
import numpy as np
import psutil
import pytest
import torch
from conftest import RELOAD_MLP, Daemon, base_config, held_reload_repo, hold_boots, module_daemon, wait_for
from wire import RawPeer

from inferd import AsyncClient
from inferd.client import Reply

BIN = Path(sys.executable).parent
MLP = RELOAD_MLP


def expected(references, version: str, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return references[version](torch.from_numpy(x)).numpy()


def inferctl(daemon: Daemon, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, *argv],
                          capture_output=True, text=True, timeout=timeout)


class Traffic:
    """Client threads sending continuously; every reply is kept with when its request was sent."""

    def __init__(self, daemon: Daemon, threads: int = 6) -> None:
        self.daemon = daemon
        self.stop = threading.Event()
        self.records: list[tuple[float, dict, np.ndarray, np.ndarray]] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        self.wait_for_more(20)
        return self

    def wait_for_more(self, count: int) -> None:
        """Wait until `count` more replies have come."""
        target = len(self.records) + count
        wait_for(lambda: len(self.records) >= target or self.errors, what=f"{count} more replies")

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()

    def _run(self, k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            with RawPeer(self.daemon.endpoint) as peer:
                i = 0
                while not self.stop.is_set():
                    x = rng.standard_normal((int(rng.integers(1, 4)), models.MLP_IN), dtype=np.float32)
                    sent = time.monotonic()
                    peer.send(i, "mlp", [x], timeout_ms=10_000)
                    header, outputs = peer.recv()
                    with self._lock:
                        self.records.append((sent, header, x, outputs[0] if outputs else None))
                    i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def check(self, references) -> None:
        """No error, every reply ok and equal to its named version's model in-process."""
        assert not self.errors, self.errors
        bad = [h for _, h, _, _ in self.records if h["status"] != "ok"]
        assert not bad, bad[:3]
        for _, header, x, y in self.records:
            np.testing.assert_allclose(y, expected(references, header["version"], x), rtol=1e-5, atol=1e-6)


def test_reloads_under_load_drop_nothing_and_every_reply_names_its_version(reload_daemon, references):
    daemon = reload_daemon(workers={"devices": ["cpu", "cpu"]})
    switches: list[tuple[float, float, str]] = []  # (began, returned, version made live)
    with Traffic(daemon) as traffic:
        # Back to back: the old version of one reload may still be retiring when the next begins.
        for version in ["v2", "v1"] * 3:
            began = time.monotonic()
            live = daemon.call("reload", timeout=60, version=version)["version"]
            switches.append((began, time.monotonic(), live))
        for _ in range(2):
            began = time.monotonic()
            result = inferctl(daemon, "rollback", "--yes")
            assert result.returncode == 0, result.stderr
            switches.append((began, time.monotonic(), result.stdout.strip().splitlines()[-1].split()[1]))
    assert [v for _, _, v in switches] == ["v2", "v1"] * 3 + ["v2", "v1"]
    traffic.check(references)
    assert len(traffic.records) > 100
    for sent, header, _, _ in traffic.records:
        done = [i for i, (_, returned, _) in enumerate(switches) if returned < sent]
        if done:
            # The version of the last switch that had returned; or that of the next one,
            # only if it had begun (it may have flipped meanwhile).
            k = done[-1]
            allowed = {switches[k][2]}
            if k + 1 < len(switches) and switches[k + 1][0] < sent:
                allowed.add(switches[k + 1][2])
            assert header["version"] in allowed, (sent, header["version"], switches)
    # Each worker freed the old version once its last batch was back.
    wait_for(lambda: all(w["loaded"] == ["mlp v1"] for w in daemon.status()["workers"]), timeout=10,
             what="the old versions freed")


def test_reload_prints_its_progress_and_timings(reload_daemon):
    daemon = reload_daemon()
    result = inferctl(daemon, "reload", "--version", "v2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "loading mlp v2 beside v1 on 1 worker(s)" in lines[0]
    assert any("worker0: loaded in" in line and "warmed up in" in line for line in lines)
    assert any("switched mlp from v1 to v2" in line for line in lines)
    assert lines[-1].startswith("mlp v2 is live (was v1): load ")
    assert daemon.status()["models"]["mlp"]["live_version"] == "v2"


def assert_timing_sane(reply: Reply, elapsed_s: float) -> None:
    """The daemon's timing of a call that took the client `elapsed_s`: its parts in order, within the whole."""
    timing = reply.timing_us
    assert timing.queue >= 0 and timing.compute > 0, timing
    assert timing.queue + timing.compute <= timing.total <= elapsed_s * 1e6, (timing, elapsed_s)


def test_the_python_clients_tell_which_version_answered_and_its_timing(reload_daemon, references):
    daemon = reload_daemon()
    x = np.random.default_rng(7).standard_normal((3, models.MLP_IN), dtype=np.float32)

    async def call_async() -> tuple[Reply, float]:
        async with AsyncClient(daemon.endpoint, timeout=20) as client:
            began = time.monotonic()
            reply = await client.submit("mlp", x, details=True)
            return reply, time.monotonic() - began

    with daemon.client() as client:
        for version in ("v1", "v2"):
            if version != "v1":
                daemon.call("reload", timeout=60, version=version)
            plain = client.infer("mlp", x)  # what infer returns is unchanged
            np.testing.assert_allclose(plain, expected(references, version, x), rtol=1e-5, atol=1e-6)
            began = time.monotonic()
            replies = [(client.submit("mlp", x, details=True).result(), time.monotonic() - began),
                       asyncio.run(call_async())]
            for reply, elapsed in replies:
                assert reply.version == version
                np.testing.assert_allclose(reply.outputs, expected(references, version, x), rtol=1e-5, atol=1e-6)
                assert_timing_sane(reply, elapsed)


REFUSALS = [
    ("missing", [], "version 'missing' has no model.py, model.pt or model.pt2"),
    ("corrupt", [], "is not a TorchScript or torch.export archive; save it with torch.export.save"),
    ("refuses_big", [], "warm-up of mlp refuses_big at batch 16 failed"),
    ("wide", [], "outputs float32 [N, 8], but the live version outputs float32 [N, 4]"),
    ("canary_bad", [], "does not reproduce expected_output.npy"),
]


@pytest.fixture(scope="module")
def untouched(reload_repo: Path) -> Iterator[Daemon]:
    """One daemon for the tests that leave it as they found it: v1 live, never switched from (every reload
    they ask for is refused or has nothing to do)."""
    with module_daemon(reload_repo, {"mlp": MLP}) as daemon:
        yield daemon


@pytest.mark.parametrize("version, extra, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_reload_keeps_the_old_version_serving(untouched, references, version, extra, message):
    daemon = untouched
    with Traffic(daemon, threads=3) as traffic:
        result = inferctl(daemon, "reload", "--version", version, *extra)
        traffic.wait_for_more(20)  # the old version serves on after the refusal
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr, result.stderr
    traffic.check(references)
    assert {h["version"] for _, h, _, _ in traffic.records} == {"v1"}
    status = daemon.status()
    assert status["models"]["mlp"]["live_version"] == "v1"
    assert status["workers"][0]["loaded"] == ["mlp v1"]


def test_a_reload_to_the_live_version_succeeds_doing_nothing_so_scripts_can_rerun_it(untouched):
    daemon = untouched
    for _ in range(2):
        result = inferctl(daemon, "reload", "--version", "v1")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == "mlp v1 is already live; nothing to do"
    assert daemon.status()["models"]["mlp"]["previous_version"] is None, "no switch happened"
    result = inferctl(daemon, "reload", "--version", "v1", "--canary", "5")
    assert result.returncode == 1 and "mlp v1 is already live; a trial needs another version" in result.stderr


def test_signature_change_is_accepted_when_allowed(reload_daemon):
    daemon = reload_daemon()
    result = inferctl(daemon, "reload", "--version", "wide", "--allow-signature-change")
    assert result.returncode == 0, result.stderr
    with daemon.client() as client:
        assert client.infer("mlp", np.zeros((2, models.MLP_IN), dtype=np.float32)).shape == (2, 8)


def test_a_version_whose_full_batch_would_overflow_an_arena_slot_is_refused(reload_daemon):
    # 1 MiB over 2 streams: 256 KiB slots; a full batch of 16 at 64 KiB a sample needs 1 MiB.
    daemon = reload_daemon(workers={"shm_mb": 1})
    result = inferctl(daemon, "reload", "--version", "huge_output", "--allow-signature-change")
    assert result.returncode == 1
    assert "arena slot" in result.stderr and "raise workers.shm_mb" in result.stderr, result.stderr
    assert daemon.status()["models"]["mlp"]["live_version"] == "v1"
    with daemon.client() as client:
        assert client.infer("mlp", np.zeros((16, models.MLP_IN), dtype=np.float32)).shape == (16, models.MLP_OUT)


def test_a_version_that_reproduces_its_canary_is_accepted(reload_daemon):
    daemon = reload_daemon()
    assert inferctl(daemon, "reload", "--version", "canary_good").returncode == 0
    assert daemon.status()["models"]["mlp"]["live_version"] == "canary_good"


def test_the_memory_guard_refuses_with_the_numbers(reload_daemon):
    daemon = reload_daemon(workers={"reload_memory_factor": 1e9})
    result = inferctl(daemon, "reload", "--version", "v2")
    assert result.returncode == 1
    assert "host memory has" in result.stderr and "MiB free, but mlp v2" in result.stderr
    assert "workers.reload_memory_factor = 1e+09" in result.stderr
    assert daemon.status()["models"]["mlp"]["live_version"] == "v1"


def test_memory_comes_back_after_a_refused_reload(untouched):
    daemon = untouched
    worker = psutil.Process(daemon.status()["workers"][0]["pid"])
    before = worker.memory_info().rss
    result = inferctl(daemon, "reload", "--version", "huge_failing")
    assert result.returncode == 1 and "this version never works" in result.stderr
    after = worker.memory_info().rss
    # The version held 286 MiB of weights while it loaded; all of it went back.
    assert after - before < 40 * 2**20, (before >> 20, after >> 20)


def test_a_second_reload_of_the_same_model_is_refused_while_one_runs(reload_daemon):
    daemon = reload_daemon()
    # The worker is stopped until the second reload has been answered, so the first one is still
    # running then however slow the machine (a warm-up's length would be a guess).
    worker = psutil.Process(daemon.status()["workers"][0]["pid"])
    worker.suspend()
    first = subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "reload", "--version", "v2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "loading mlp v2" in first.stdout.readline()
        second = inferctl(daemon, "reload", "--version", "v3")
        assert second.returncode == 1
        assert "a reload of mlp (to v2) is already running" in second.stderr
        worker.resume()
        assert first.wait(120) == 0
    finally:
        worker.resume()
        first.kill()
    assert daemon.status()["models"]["mlp"]["live_version"] == "v2"


def test_restart_serves_the_reloaded_version_and_rollback_still_works(reload_daemon, workdir):
    daemon = reload_daemon()
    assert inferctl(daemon, "reload", "--version", "v3").returncode == 0
    assert daemon.stop() == 0
    daemon.start()
    status = daemon.status()["models"]["mlp"]
    assert status["live_version"] == "v3", "the config says v1, but the saved live version wins"
    assert status["live_from"] == "saved" and status["config_version"] == "v1"
    assert status["previous_version"] == "v1"
    assert "live v3           queued 0  (saved live version; the config says v1)" in inferctl(daemon, "status").stdout
    assert ("serving mlp v3, the version saved as live in " f"{daemon.config['server']['state_dir']}/live_versions"
            ".json, not the config's v1 (version = 'v1')") in daemon.log()
    result = inferctl(daemon, "rollback")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("mlp has no canary or shadow; a rollback would switch it from v3 back to v1 (blue-green): run it again "
            "with --yes") in result.stderr, result.stderr
    assert daemon.status()["models"]["mlp"]["live_version"] == "v3", "nothing switched without --yes"
    result = inferctl(daemon, "rollback", "--yes")
    assert result.returncode == 0, result.stderr
    assert "mlp v1 is live (was v3)" in result.stdout
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "mlp", [np.zeros((1, models.MLP_IN), dtype=np.float32)])
        assert peer.recv()[0]["version"] == "v1"


def test_a_live_version_another_config_saved_in_the_same_state_dir_is_not_served(reload_daemon, workdir):
    # Two configs in two folders share one state_dir, as two left at the default (/var/lib/inferd as root) do.
    shared = {"state_dir": str(workdir / "state")}
    folders = [workdir / "first", workdir / "second"]
    for folder in folders:
        folder.mkdir()
    first = reload_daemon(folders[0], server=shared)
    assert inferctl(first, "reload", "--version", "v2").returncode == 0
    assert first.stop() == 0
    second = reload_daemon(folders[1], server=shared)
    status = second.status()["models"]["mlp"]
    assert status["live_version"] == "v1" and status["live_from"] == "config", "the first config's v2 was served"
    assert (f"ignoring {workdir}/state/live_versions.json: the daemon of {folders[0]}/inferd.toml saved it, and "
            f"this one runs {folders[1]}/inferd.toml; it serves its config's versions") in second.log()


def test_rollback_without_a_reload_says_so(untouched):
    daemon = untouched
    result = inferctl(daemon, "rollback")
    assert result.returncode == 1 and "mlp has not been reloaded" in result.stderr


def test_a_crashed_worker_comes_back_on_the_live_version(reload_daemon):
    daemon = reload_daemon()
    assert inferctl(daemon, "reload", "--version", "v2").returncode == 0
    os.kill(daemon.status()["workers"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["workers"][0])["restarts"] == 1 and w["state"] == "ready",
             timeout=60, what="the replacement ready")
    worker = daemon.status()["workers"][0]
    assert worker["restarts"] == 1 and worker["loaded"] == ["mlp v2"]


def test_a_worker_that_starts_during_a_reload_catches_up(reload_daemon, reload_repo, references, workdir):
    repo, hold = held_reload_repo(reload_repo, workdir, "v2")
    daemon = reload_daemon(repo=repo, workers={"devices": ["cpu", "cpu"]})
    gate = hold_boots(hold)
    os.kill(daemon.status()["workers"][1]["pid"], signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["workers"][1])["generation"] == 2 and w["state"] == "booting",
             what="worker1 booting again")
    # worker1 now boots on v1 (the live version when it was spawned), held at the gate while v2 goes live.
    result = daemon.call("reload", timeout=60, version="v2")
    assert result["version"] == "v2"
    assert daemon.status()["workers"][1]["state"] == "booting"
    gate.open()
    wait_for(lambda: daemon.status()["workers"][1]["loaded"] == ["mlp v2"], timeout=60, what="worker1 on v2")
    assert "worker1: catching up mlp to the live version v2" in daemon.log()
    with Traffic(daemon, threads=4) as traffic:
        traffic.wait_for_more(100)
    traffic.check(references)
    assert {h["version"] for _, h, _, _ in traffic.records} == {"v2"}


def test_versions_lists_the_repository_and_the_live_one(untouched):
    daemon = untouched
    result = inferctl(daemon, "versions")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "mlp:"
    live = [line for line in lines if "(live)" in line]
    assert len(live) == 1 and " v1 " in live[0] and "model.pt" in live[0] and "MiB" in live[0]
    assert any(" v3 " in line for line in lines) and any("huge_failing" in line for line in lines)


def test_commands_that_need_a_model_name_it_when_several_are_served(workdir, reload_repo, repo):
    config = base_config(workdir, reload_repo, {"mlp": MLP})
    config["models"]["other"] = {"repository": str(repo / "mlp"), **MLP}
    daemon = Daemon(workdir, config).start()
    try:
        result = inferctl(daemon, "reload", "--version", "v2")
        assert result.returncode == 1
        assert "this daemon serves several models (mlp, other); name one with --model" in result.stderr
        assert inferctl(daemon, "reload", "--version", "v2", "--model", "mlp").returncode == 0
        assert daemon.status()["models"]["other"]["live_version"] == "v1"
    finally:
        daemon.kill_all()
