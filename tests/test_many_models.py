"""Many models: a folder per model under server.model_root, read at start and again on SIGHUP."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import models
import numpy as np
import tritonclient.http as httpclient
from conftest import MLP, PAIR, Daemon, base_config, reference, wait_for

from inferd.harness import free_port, to_toml

BIN = Path(sys.executable).parent


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
    config = base_config(workdir, repo, {}, server={"model_root": str(root), "http": f"127.0.0.1:{free_port()}",
                                                    "grpc": ""})
    daemon = Daemon(workdir, config).start()
    try:
        assert sorted(daemon.status()["models"]) == ["alpha", "beta"]
        x = np.random.default_rng(35).standard_normal((3, models.MLP_IN), dtype=np.float32)
        a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        b = np.array([[1, 2], [3, -4]], dtype=np.int64)
        with daemon.client() as client:
            np.testing.assert_allclose(client.infer("alpha", x), reference(repo, "mlp", "v1")(x), rtol=1e-5,
                                       atol=1e-6)
            for got, want in zip(client.infer("beta", [a, b]), reference(repo, "pair", "v1")(a, b), strict=True):
                np.testing.assert_array_equal(got, want)
        model_folder(root, "gamma", repo / "mlp", {**MLP, "version": "v2"})
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: "gamma v2" in daemon.status()["workers"][0]["loaded"], timeout=60, what="gamma loaded")
        with daemon.client() as client:
            np.testing.assert_allclose(client.infer("gamma", x), reference(repo, "mlp", "v2")(x), rtol=1e-5,
                                       atol=1e-6)
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
