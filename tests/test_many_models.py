"""Many models: a folder per model under server.model_root, read at start and again on SIGHUP."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import (
    MLP,
    ONE_AT_A_TIME,
    PAIR,
    Daemon,
    base_config,
    gated_reload_repo,
    module_daemon,
    reference,
    wait_for,
)
from gates import Gate
from test_observability import scrape
from tritonclient.utils import InferenceServerException
from wire import RawPeer

from inferd.harness import free_port, to_toml

BIN = Path(sys.executable).parent
MANY = 1000  # on-demand models in one model_root


def model_folder(root: Path, name: str, source: Path, model: dict[str, Any]) -> Path:
    """`root`/`name`: the versions of the test repository's `source` and a model.toml of `model`'s keys."""
    shutil.copytree(source, root / name)
    (root / name / "model.toml").write_text(to_toml(model))
    return root / name


def test_each_folder_of_model_root_is_served_and_a_sighup_serves_a_folder_added(workdir, repo):
    root = workdir / "models"
    model_folder(root, "alpha", repo / "mlp", {**MLP, "version": "v1"})
    model_folder(root, "beta", repo / "pair", PAIR)
    (root / "scratch").mkdir()  # no model.toml: not a model
    lazy = to_toml({**MLP, "version": "v1", "load": "on_demand"})
    for index in range(MANY):  # loaded only when asked for, so they cost the start little
        (root / f"lazy{index}").mkdir()
        (root / f"lazy{index}" / "v1").symlink_to(repo / "mlp" / "v1")
        (root / f"lazy{index}" / "model.toml").write_text(lazy)
    config = base_config(workdir, repo, {}, server={"model_root": str(root), "http": f"127.0.0.1:{free_port()}",
                                                    "grpc": ""})
    daemon = Daemon(workdir, config).start()
    try:
        assert len(daemon.status()["models"]) == MANY + 2
        assert daemon.status()["workers"][0]["loaded"] == ["alpha v1", "beta v1"]
        x = np.random.default_rng(35).standard_normal((3, models.MLP_IN), dtype=np.float32)
        a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        b = np.array([[1, 2], [3, -4]], dtype=np.int64)
        with daemon.client() as client:
            np.testing.assert_allclose(client.infer("alpha", x), reference(repo, "mlp", "v1")(x), rtol=1e-5,
                                       atol=1e-6)
            for got, want in zip(client.infer("beta", [a, b]), reference(repo, "pair", "v1")(a, b), strict=True):
                np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(client.infer(f"lazy{MANY - 1}", x), reference(repo, "mlp", "v1")(x),
                                       rtol=1e-5, atol=1e-6)
        model_folder(root, "gamma", repo / "mlp", {**MLP, "version": "v2"})
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: "gamma v2" in daemon.status()["workers"][0]["loaded"], timeout=60, what="gamma loaded")
        with daemon.client() as client:
            np.testing.assert_allclose(client.infer("gamma", x), reference(repo, "mlp", "v2")(x), rtol=1e-5,
                                       atol=1e-6)
        model_folder(root, "delta", repo / "pair", PAIR)  # no SIGHUP: inferctl load reads the folder again
        load = subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, "load", "--model", "delta"],
                              capture_output=True, text=True, timeout=120)
        assert load.returncode == 0 and "delta v1 loaded on worker0" in load.stdout, load.stderr
        with daemon.client() as client:
            for got, want in zip(client.infer("delta", [a, b]), reference(repo, "pair", "v1")(a, b), strict=True):
                np.testing.assert_array_equal(got, want)
        http = httpclient.InferenceServerClient(config["server"]["http"])
        wait_for(lambda: http.is_model_ready("gamma"), what="gamma ready over HTTP")
        request = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        np.testing.assert_allclose(http.infer("gamma", [request]).as_numpy("OUTPUT__0"),
                                   reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    finally:
        daemon.kill_all()


def test_check_config_names_a_broken_model_toml(workdir, repo):
    root = workdir / "models"
    model_folder(root, "alpha", repo / "mlp", MLP)
    model_folder(root, "beta", repo / "mlp", {**MLP, "max_batch_size": 0})
    (root / "gamma").mkdir()
    (root / "gamma" / "model.toml").write_text("inputs = [\n")
    path = workdir / "inferd.toml"
    path.write_text(to_toml({"server": {"model_root": "models"}}))
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{root}/beta/model.toml: max_batch_size: Expected `int` >= 1, got 0" in result.stderr
    assert f"{root}/gamma/model.toml: not valid TOML" in result.stderr
    assert "alpha" not in result.stderr
    shutil.rmtree(root / "beta")
    shutil.rmtree(root / "gamma")
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "ok (1 model(s))" in result.stdout, result.stderr


def inferctl(daemon: Daemon, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, *argv], capture_output=True, text=True,
                          timeout=120)


def loaded(daemon: Daemon, *names: str) -> list[str]:
    """What every worker has loaded (of the models `names`, if given), as status lists it."""
    return sorted(entry for worker in daemon.status()["workers"] for entry in worker["loaded"]
                  if not names or entry.split()[0] in names)


def loading_in_background(daemon: Daemon, model: str) -> subprocess.Popen:
    """`inferctl load --model MODEL`, started and left to wait; its lines can be read as they come."""
    return subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "load", "--model", model],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def gated_on_demand(start_daemon: Callable[..., Daemon], workdir: Path, reload_repo: Path,
                    **sections: dict[str, Any]) -> tuple[Daemon, Gate]:
    """A daemon of the mlp and the on-demand model `slow`, whose load waits at the gate returned."""
    gated, gate = gated_reload_repo(reload_repo, workdir, "v1")
    daemon = start_daemon({"mlp": MLP, "slow": {**MLP, "load": "on_demand", "version": "gated",
                                                 "repository": str(gated / "mlp")}}, **sections)
    return daemon, gate


@pytest.fixture(scope="module")
def on_demand(repo: Path, reload_repo: Path) -> Iterator[tuple[Daemon, Path, Gate]]:
    """One daemon for the module's tests of on-demand models, each test on models of its own: mlp (always), lazy
    (mlp v2), variable, broken (a copy of mlp, whose file its test breaks), slow (its load waits at the gate
    returned), later and tried (mlp v1); and the folder of the copies."""
    made: dict[str, Any] = {}

    def copies(config: dict[str, Any], folder: Path) -> None:
        shutil.copytree(repo / "mlp", folder / "broken")
        gated, made["gate"] = gated_reload_repo(reload_repo, folder, "v1")
        made["folder"] = folder
        config["models"]["broken"]["repository"] = str(folder / "broken")
        for name in ("slow", "later"):
            config["models"][name]["repository"] = str(gated / "mlp")

    lazy = {**MLP, "load": "on_demand"}
    served = {"mlp": {**MLP, "version": "v1"}, "lazy": {**lazy, "repository": str(repo / "mlp"), "version": "v2"},
              "variable": {**ONE_AT_A_TIME, "load": "on_demand"}, "broken": {**lazy, "version": "v1"},
              "slow": {**lazy, "version": "gated"}, "later": {**lazy, "version": "v1"},
              "tried": {**lazy, "repository": str(repo / "mlp"), "version": "v1"}}
    with module_daemon(repo, served, copies) as daemon:
        yield daemon, made["folder"], made["gate"]


def test_an_on_demand_model_loads_for_the_requests_that_need_it_and_unloads_when_asked_and_idle(on_demand, repo,
                                                                                               gates):
    daemon, _, _ = on_demand
    assert loaded(daemon, "lazy", "variable") == [], "an on-demand model is loaded at start"
    assert "mlp v1" in loaded(daemon) and daemon.call("health")["healthy"]
    x = np.random.default_rng(36).standard_normal((8, 2, models.MLP_IN), dtype=np.float32)
    expected = reference(repo, "mlp", "v2")
    with daemon.client() as client:
        futures = [client.submit("lazy", sample, timeout=60) for sample in x]  # all wait for the one load
        for future, sample in zip(futures, x, strict=True):
            np.testing.assert_allclose(future.result(), expected(sample), rtol=1e-5, atol=1e-6)
    assert loaded(daemon, "lazy") == ["lazy v2"]
    assert daemon.log().count("loading lazy v2 on worker0 (on demand)") == 1
    [said] = re.findall(r"lazy v2 loaded on worker0 in [\d.]+ s \(on demand\); (\d+) request\(s\) waited", daemon.log())
    waited = daemon.call("stats")["models"]["lazy"]["loading"]["waited_for_load_ms"]
    assert 1 <= waited["count"] == int(said) <= len(x) and waited["max"] > 0, (waited, said)

    refused = inferctl(daemon, "unload", "--model", "mlp")
    assert refused.returncode == 1 and 'loaded on every worker (load = "always")' in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    unloaded = inferctl(daemon, "unload", "--model", "lazy")
    assert unloaded.returncode == 0 and "lazy unloaded from worker0" in unloaded.stdout, unloaded.stderr
    wait_for(lambda: loaded(daemon, "lazy") == [], what="lazy unloaded from the worker")

    load = inferctl(daemon, "load", "--model", "lazy")
    assert load.returncode == 0 and "lazy v2 loaded on worker0 in" in load.stdout, load.stderr
    assert loaded(daemon, "lazy") == ["lazy v2"]
    again = inferctl(daemon, "load", "--model", "lazy")
    assert again.returncode == 0 and "lazy v2 was loaded already, on worker0" in again.stdout, again.stderr
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("lazy", x[0]), expected(x[0]), rtol=1e-5, atol=1e-6)

    gate = gates()
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "variable", [gate.input])  # loads it, then its batch waits at the gate
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the held batch running")
        busy = inferctl(daemon, "unload", "--model", "variable")
        assert busy.returncode == 1 and "variable has 1 batch(es) running and 0 request(s) waiting" in busy.stderr
        assert loaded(daemon, "variable") == ["variable v1"]
        gate.open()
        assert peer.recv()[0]["status"] == "ok"
    unloaded = inferctl(daemon, "unload", "--model", "variable")
    assert unloaded.returncode == 0, unloaded.stderr
    wait_for(lambda: loaded(daemon, "variable") == [], what="variable unloaded")

    # A reload of a model loaded nowhere switches at once; the version loads where a request needs it.
    assert inferctl(daemon, "unload", "--model", "lazy").returncode == 0
    wait_for(lambda: loaded(daemon, "lazy") == [], what="lazy unloaded")
    reload = inferctl(daemon, "reload", "--model", "lazy", "--version", "v1")
    assert reload.returncode == 0 and "lazy v1 is live (was v2)" in reload.stdout, reload.stderr
    assert loaded(daemon, "lazy") == []
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("lazy", x[0]), reference(repo, "mlp", "v1")(x[0]), rtol=1e-5,
                                   atol=1e-6)
    assert loaded(daemon, "lazy") == ["lazy v1"]


def test_an_on_demand_model_that_cannot_load_is_refused_with_the_reason_and_not_tried_per_request(on_demand, repo):
    daemon, folder, _ = on_demand
    (folder / "broken" / "v1" / "model.pt").write_bytes(b"not a model")  # replaced by a bad file after the start
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "broken", [x])
        header, _ = peer.recv()
        assert header["status"] == "unavailable"
        assert header["error"].startswith("broken v1 could not be loaded (") and "tried again in 1.0 s" in \
            header["error"], header["error"]
        peer.send(2, "broken", [x])  # within the backoff: refused at once, nothing loaded
        header, _ = peer.recv()
        assert header["status"] == "unavailable" and "could not be loaded" in header["error"]
        peer.send(3, "mlp", [x])
        assert peer.recv()[0]["status"] == "ok"
    assert daemon.log().count("loading broken v1 on worker0 (on demand)") == 1
    assert loaded(daemon, "broken") == [] and daemon.status()["workers"][0]["state"] == "ready"
    shutil.copy(repo / "mlp" / "v1" / "model.pt", folder / "broken" / "v1" / "model.pt")  # mended
    load = inferctl(daemon, "load", "--model", "broken")
    assert load.returncode == 0 and "broken v1 loaded on worker0" in load.stdout, load.stderr


def test_a_version_made_live_after_a_failed_load_is_loaded_at_once_not_refused_for_the_last(start_daemon,
                                                                                             reload_repo):
    # refuses_big fails its warm-up on a batch of 16: its load fails on the worker, though its file is sound.
    daemon = start_daemon({"mlp": MLP, "m": {**MLP, "load": "on_demand", "version": "refuses_big",
                                             "repository": str(reload_repo / "mlp")}})
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "m", [x], timeout_ms=60_000)
        header, _ = peer.recv(timeout=60)
        assert header["status"] == "unavailable" and header["error"].startswith("m refuses_big could not be loaded")
        assert inferctl(daemon, "reload", "--model", "m", "--version", "v2").returncode == 0
        peer.send(2, "m", [x], timeout_ms=60_000)  # within refuses_big's backoff, but v2 never failed
        header, outputs = peer.recv(timeout=60)
    assert header["status"] == "ok" and header["version"] == "v2", header
    np.testing.assert_allclose(outputs[0], reference(reload_repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)


def test_inferctl_load_waits_while_the_worker_loads_another_model(on_demand):
    daemon, _, gate = on_demand
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "slow", [x])  # its load waits at the gate: the worker loads nothing else meanwhile
        wait_for(lambda: "loading slow gated on worker0" in daemon.log(), what="slow's load begun")
        load = loading_in_background(daemon, "later")
        try:
            assert load.stdout is not None
            assert "waiting for a worker free to load later v1" in load.stdout.readline()
            assert loaded(daemon, "later") == []
            gate.open()
            out, err = load.communicate(timeout=120)
        finally:
            load.kill()
        assert load.returncode == 0 and "later v1 loaded on worker0" in out, err
        assert peer.recv()[0]["status"] == "ok"
    assert daemon.log().index("slow gated loaded on worker0") < daemon.log().index("loading later v1 on worker0")


def test_an_on_demand_model_is_not_unloaded_under_its_own_load_whose_command_is_answered(start_daemon, workdir,
                                                                                           reload_repo):
    daemon, gate = gated_on_demand(start_daemon, workdir, reload_repo)
    load = loading_in_background(daemon, "slow")
    try:
        assert load.stdout is not None
        assert "loading slow gated on worker0" in load.stdout.readline()
        # Unloaded under its load, the load's answer was lost: its inferctl waited out workers.load_timeout_s.
        refused = inferctl(daemon, "unload", "--model", "slow")
        assert refused.returncode == 1 and "slow is loading on worker0; it is unloaded only once loaded" in \
            refused.stderr, refused.stderr
        gate.open()
        out, err = load.communicate(timeout=120)
    finally:
        gate.close()
        load.kill()
    assert load.returncode == 0 and "slow gated loaded on worker0" in out, err
    assert inferctl(daemon, "unload", "--model", "slow").returncode == 0
    assert loaded(daemon, "slow") == []


def test_an_on_demand_load_that_hangs_fails_as_a_refused_one_does_and_waits_out_its_backoff(start_daemon, workdir,
                                                                                               reload_repo):
    daemon, gate = gated_on_demand(start_daemon, workdir, reload_repo, workers={"load_timeout_s": 2})  # never opened
    try:
        with RawPeer(daemon.endpoint) as peer:
            peer.send(1, "slow", [np.ones((1, models.MLP_IN), np.float32)], timeout_ms=60_000)
            header, _ = peer.recv(timeout=60)
        # Before, the worker was replaced and the load placed again on its successor at once, for as long as a
        # request waited: answered `timeout` in the end, with no failure counted and no backoff.
        assert header["status"] == "unavailable", header
        assert header["error"] == ("slow gated could not be loaded (worker0 did not load slow gated within "
                                   "workers.load_timeout_s (2 s)); it is tried again in 1.0 s"), header
        assert daemon.call("stats")["models"]["slow"]["loading"]["failed_loads"] == 1
    finally:
        gate.close()


def test_a_canary_or_shadow_of_an_on_demand_model_loads_where_the_live_version_is_and_none_starts_elsewhere(
        on_demand, repo):
    daemon, _, _ = on_demand
    refused = inferctl(daemon, "reload", "--model", "tried", "--version", "v2", "--canary", "50")
    assert refused.returncode == 1 and "tried is loaded on no worker, so nothing would compare v2 with it; " \
        "`inferctl load --model tried` first" in refused.stderr, refused.stderr
    assert inferctl(daemon, "load", "--model", "tried").returncode == 0
    canary = inferctl(daemon, "reload", "--model", "tried", "--version", "v2", "--canary", "50")
    assert canary.returncode == 0, canary.stderr
    assert loaded(daemon, "tried") == ["tried v1", "tried v2"]
    x = np.random.default_rng(38).standard_normal((1, models.MLP_IN), dtype=np.float32)
    answered = set()
    with RawPeer(daemon.endpoint) as peer:
        for index in range(40):
            peer.send(index, "tried", [x])
            header, outputs = peer.recv()
            assert header["status"] == "ok"
            np.testing.assert_allclose(outputs[0], reference(repo, "mlp", header["version"])(x), rtol=1e-5, atol=1e-6)
            answered.add(header["version"])
    assert answered == {"v1", "v2"}
    assert inferctl(daemon, "promote", "--model", "tried").returncode == 0
    wait_for(lambda: loaded(daemon, "tried") == ["tried v2"], what="v1 unloaded once v2 is live")
    # A shadow too is loaded where the live version is, and computes on it.
    shadow = inferctl(daemon, "reload", "--model", "tried", "--version", "v1", "--shadow", "100")
    assert shadow.returncode == 0, shadow.stderr
    assert loaded(daemon, "tried") == ["tried v1", "tried v2"]
    with RawPeer(daemon.endpoint) as peer:
        for index in range(10):
            peer.send(index, "tried", [x])
            header, outputs = peer.recv()
            assert header["status"] == "ok" and header["version"] == "v2"
            np.testing.assert_allclose(outputs[0], reference(repo, "mlp", "v2")(x), rtol=1e-5, atol=1e-6)
    wait_for(lambda: daemon.call("stats")["models"]["tried"]["shadow"]["v1"]["compared"] >= 1,
             what="the shadow's outputs compared with the live version's")
    assert inferctl(daemon, "rollback", "--model", "tried").returncode == 0
    wait_for(lambda: loaded(daemon, "tried") == ["tried v2"], what="the shadow unloaded once ended")


def test_more_on_demand_models_than_the_budget_holds_rotate_within_it_and_one_too_big_is_refused(start_daemon,
                                                                                                repo):
    names = [f"m{i}" for i in range(4)]
    served = {name: {**MLP, "repository": str(repo / "mlp"), "version": "v1", "load": "on_demand"} for name in names}
    daemon = start_daemon({**served, "big": {**MLP, "load": "on_demand"}},
                          server={"metrics": f"127.0.0.1:{free_port()}"})
    x = np.random.default_rng(37).standard_normal((2, models.MLP_IN), dtype=np.float32)
    expected = reference(repo, "mlp", "v1")(x)
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("m0", x), expected, rtol=1e-5, atol=1e-6)
    size = daemon.status()["workers"][0]["model_memory_bytes"]
    assert 2704 <= size < 11233, size  # its weights (676 float32), and less than its file
    budget = int(size * 2.5)  # two of them fit, not three
    config = daemon.config
    config["workers"]["model_memory_mb"] = budget / 2**20
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "workers.model_memory_mb 0 ->" in daemon.log(), what="the budget applied")
    with daemon.client() as client:
        for _ in range(3):
            for name in names:
                np.testing.assert_allclose(client.infer(name, x), expected, rtol=1e-5, atol=1e-6)
                [worker] = daemon.call("stats")["workers"]
                assert worker["model_memory_bytes"] <= budget and len(worker["models"]) <= 2, worker
    loading = {name: daemon.call("stats")["models"][name]["loading"] for name in names}
    assert all(entry["loads"] >= 3 and entry["unloads"] >= 2 for entry in loading.values()), loading
    assert all(entry["load_ms"]["count"] == entry["loads"] for entry in loading.values())
    scraped = scrape(daemon)
    for name in names:
        assert scraped[("inferd_model_loads_total", (("model", name), ("outcome", "loaded")))] == loading[name]["loads"]
        assert scraped[("inferd_model_unloads_total", (("model", name),))] == loading[name]["unloads"]
        assert scraped[("inferd_model_load_seconds_count", (("model", name),))] == loading[name]["loads"]
    assert scraped[("inferd_worker_model_memory_bytes", (("worker", "0"),))] <= budget
    held = {dict(labels)["model"] for (metric, labels), value in scraped.items()
            if metric == "inferd_worker_model_loaded" and value == 1}
    assert held == set(daemon.call("stats")["workers"][0]["models"]) and len(held) == 2
    with RawPeer(daemon.endpoint) as peer:
        peer.send(1, "big", [x])
        header, _ = peer.recv()
    assert header["status"] == "unavailable"
    assert header["error"].startswith("big v1 could not be loaded (it holds 0.3") and \
        "more than workers.model_memory_mb" in header["error"], header["error"]
    assert daemon.call("stats")["workers"][0]["models"] != ["big"]


def test_a_model_with_a_batch_running_is_not_unloaded_to_make_room_the_waiting_model_loads_once_it_is_idle(
        start_daemon, repo, gates):
    one = {**ONE_AT_A_TIME, "repository": str(repo / "variable"), "load": "on_demand"}
    daemon = start_daemon({"busy": one, "waiting": one}, workers={"streams": 1})
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    with daemon.client() as client:
        for name in ("busy", "waiting"):  # each loaded once: placement knows their sizes
            np.testing.assert_array_equal(client.infer(name, x), x)
    size = daemon.call("stats")["workers"][0]["model_memory_bytes"] / 2
    assert inferctl(daemon, "unload", "--model", "waiting").returncode == 0
    config = daemon.config
    config["workers"]["model_memory_mb"] = 1.5 * size / 2**20  # one of them fits, not two
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "workers.model_memory_mb 0 ->" in daemon.log(), what="the budget applied")
    gate = gates()
    with RawPeer(daemon.endpoint) as peer:
        peer.send("held", "busy", [gate.input])
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="busy's batch running")
        peer.send("next", "waiting", [x], timeout_ms=60_000)
        wait_for(lambda: daemon.call("stats")["models"]["waiting"]["queue_depth"] == 1, what="the request queued")
        daemon.status()  # a later turn of the loop: placement has seen the request since
        assert daemon.log().count("loading waiting v1") == 1 and loaded(daemon) == ["busy v1"]  # the first load
        gate.open()
        replies = {header["id"]: (header, outputs) for header, outputs in (peer.recv(), peer.recv())}
    assert replies["held"][0]["status"] == "ok" and replies["next"][0]["status"] == "ok"
    np.testing.assert_array_equal(replies["next"][1][0], x)
    assert "unloading busy from worker0 (to make room for waiting)" in daemon.log()
    assert loaded(daemon) == ["waiting v1"]


def test_the_model_repository_extension_over_http_and_grpc_with_tritonclient(start_daemon, repo):
    lazy = {**MLP, "repository": str(repo / "mlp"), "load": "on_demand"}
    daemon = start_daemon({"mlp": MLP, "lazy": lazy, "fresh": lazy},
                          server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"})
    http = httpclient.InferenceServerClient(daemon.config["server"]["http"])
    grpc = grpcclient.InferenceServerClient(daemon.config["server"]["grpc"])
    assert sorted((m["name"], m["state"]) for m in http.get_model_repository_index()) == [
        ("fresh", "UNAVAILABLE"), ("lazy", "UNAVAILABLE"), ("mlp", "READY")]
    [lazy] = [m for m in http.get_model_repository_index() if m["name"] == "lazy"]
    assert lazy == {"name": "lazy", "version": "2", "state": "UNAVAILABLE", "reason": "not loaded on any worker"}
    assert not http.is_model_ready("lazy") and not grpc.is_model_ready("lazy")
    http.load_model("lazy")
    assert http.is_model_ready("lazy") and "lazy v2" in daemon.status()["workers"][0]["loaded"]
    # The other front end, a process of its own, reads the models again once its word is a second old.
    wait_for(lambda: grpc.is_model_ready("lazy"), what="the gRPC front end seeing lazy loaded")
    grpc.unload_model("lazy")
    assert not grpc.is_model_ready("lazy") and "lazy v2" not in daemon.status()["workers"][0]["loaded"]
    wait_for(lambda: not http.is_model_ready("lazy"), what="the HTTP front end seeing lazy unloaded")
    ready_only = grpc.get_model_repository_index(as_json=True)
    assert [m["name"] for m in ready_only["models"] if m.get("state") == "READY"] == ["mlp"]
    grpc.load_model("lazy")
    assert grpc.is_model_ready("lazy")
    assert {m["name"]: m["state"] for m in grpc.get_model_repository_index(as_json=True)["models"]} == {
        "fresh": "UNAVAILABLE", "lazy": "READY", "mlp": "READY"}
    for client in (http, grpc):
        with pytest.raises(InferenceServerException, match="unknown model 'nosuch'"):
            client.load_model("nosuch")
        with pytest.raises(InferenceServerException, match='mlp is loaded on every worker'):
            client.unload_model("mlp")
    x = np.ones((1, models.MLP_IN), dtype=np.float32)
    expected = reference(repo, "mlp", "v2")(x)
    request = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    request.set_data_from_numpy(x)
    grpc_request = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    grpc_request.set_data_from_numpy(x)
    # Never loaded, its outputs unknown to the front ends until it is: each has it loaded first.
    np.testing.assert_allclose(grpc.infer("fresh", [grpc_request]).as_numpy("OUTPUT__0"), expected, rtol=1e-5,
                               atol=1e-6)
    grpc.unload_model("fresh")
    np.testing.assert_allclose(http.infer("fresh", [request]).as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(http.infer("lazy", [request]).as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-6)


def test_a_model_whose_queue_stays_long_gets_a_copy_on_another_worker_and_that_copy_is_the_first_to_go(
        start_daemon, repo, gates):
    one = {**ONE_AT_A_TIME, "repository": str(repo / "variable"), "load": "on_demand"}
    daemon = start_daemon({name: one for name in ("variable", "early", "other", "new")},
                          workers={"devices": ["cpu", "cpu"], "streams": 1})
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    with daemon.client() as client:
        for name in ("early", "other", "new"):  # each to the worker holding fewer models, the first on a tie
            np.testing.assert_array_equal(client.infer(name, x), x)
    # `new` loaded once, so that placement knows its size (else it takes its file's, which is larger)
    assert inferctl(daemon, "unload", "--model", "new").returncode == 0
    wait_for(lambda: [w["models"] for w in daemon.call("stats")["workers"]] == [["early"], ["other"]],
             what="one model on each worker")
    held = [gates(), gates()]
    with RawPeer(daemon.endpoint) as peer:
        for index, gate in enumerate(held):  # the one executor of the worker that loads it: one running, one next
            peer.send(100 + index, "variable", [gate.input])
        wait_for(lambda: sum(w["batches_in_flight"] for w in daemon.status()["workers"]) == 2,
                 what="both held batches sent")
        [holder] = [w["worker"] for w in daemon.status()["workers"] if w["batches_in_flight"]]
        for index in range(3):  # more than two full batches wait, with every executor of the model busy
            peer.send(index, "variable", [x])
        replies = {}
        while len(replies) < 3:  # answered by the copy while the first worker's batches are held
            header, outputs = peer.recv(timeout=60)
            replies[header["id"]] = (header["status"], outputs)
        assert sorted(replies) == [0, 1, 2] and all(status == "ok" for status, _ in replies.values())
        assert all(np.array_equal(outputs[0], x) for _, outputs in replies.values())
        workers = daemon.status()["workers"]
        assert all("variable v1" in w["loaded"] for w in workers), workers
        assert f"loading variable v1 on worker{1 - holder} (on demand)" in daemon.log()
        for gate in held:
            gate.open()
        assert {peer.recv()[0]["id"] for _ in held} == {100, 101}

    # Each worker now holds two of these (equal) models; a budget of two and a half makes a third need an
    # unload. The worker that takes it unloads its idle copy of `variable`, used last but held elsewhere too,
    # rather than its least recently used model, held nowhere else.
    [size] = {w["model_memory_bytes"] / 2 for w in daemon.call("stats")["workers"]}
    config = daemon.config
    config["workers"]["model_memory_mb"] = 2.5 * size / 2**20
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "workers.model_memory_mb 0 ->" in daemon.log(), what="the budget applied")
    with daemon.client() as client:
        np.testing.assert_array_equal(client.infer("new", x), x)
    assert "unloading variable from worker0 (to make room for new)" in daemon.log()
    assert [sorted(w["models"]) for w in daemon.call("stats")["workers"]] == [["early", "new"],
                                                                           ["other", "variable"]]
