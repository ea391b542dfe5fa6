"""`inferd` and `inferctl` as an operator runs them: exit codes, output, one-sentence errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import models
import numpy as np
import pytest
import torch
from conftest import MLP, Daemon, base_config

from inferd.harness import to_toml

BIN = Path(sys.executable).parent


def run(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def inferctl(daemon: Daemon, *argv: str) -> subprocess.CompletedProcess:
    return run(str(BIN / "inferctl"), "--control", daemon.control, *argv)


def assert_one_sentence(result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_version():
    result = run(str(BIN / "inferd"), "--version")
    assert result.returncode == 0 and result.stdout.strip() == "inferd 0.1.0"


def test_check_config_accepts_a_good_config(workdir, repo):
    path = workdir / "good.toml"
    path.write_text(to_toml(base_config(workdir, repo, {"mlp": MLP})))
    result = run(str(BIN / "inferd"), "check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert "ok (1 model(s))" in result.stdout


def test_check_config_names_every_problem(workdir, repo):
    path = workdir / "bad.toml"
    path.write_text('[workers]\nstreams = 0\ncolour = "red"\n[models.m]\nmax_batch_size = 4\n')
    result = run(str(BIN / "inferd"), "check-config", "--config", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    problems = ("workers.streams: Expected `int` >= 1, got 0", "workers.colour: unknown key",
                "models.m.inputs: required")
    for key in problems:
        assert key in result.stderr


def test_serve_with_a_bad_config_is_one_sentence(workdir):
    path = workdir / "bad.toml"
    path.write_text("[server]\nlisten = 3\n")
    result = run(str(BIN / "inferd"), "serve", "--config", str(path))
    assert_one_sentence(result)
    assert "server.listen" in result.stderr


@pytest.fixture(scope="module")
def daemon(repo):
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="inferd-c"))
    d = Daemon(path, base_config(path, repo, {"mlp": MLP, "slow": {"inputs": [{"dtype": "float32", "shape": [64]}]}}))
    d.start()
    yield d
    d.kill_all()
    shutil.rmtree(path, ignore_errors=True)


def test_health_is_zero_when_serving(daemon):
    result = inferctl(daemon, "health")
    assert result.returncode == 0 and result.stdout.strip() == "healthy"


def test_health_is_one_without_a_daemon(workdir):
    result = run(str(BIN / "inferctl"), "--control", f"ipc://{workdir}/none.sock", "health")
    assert result.returncode == 1
    assert_one_sentence(result)
    assert "no daemon is listening" in result.stderr


def test_status_shows_models_and_workers(daemon):
    result = inferctl(daemon, "status")
    assert result.returncode == 0, result.stderr
    assert "serving" in result.stdout
    assert "mlp" in result.stdout and "live v2" in result.stdout
    assert "worker0" in result.stdout and "ready" in result.stdout


def test_status_json(daemon):
    status = json.loads(inferctl(daemon, "status", "--json").stdout)
    assert status["models"]["mlp"]["live_version"] == "v2"
    assert status["workers"][0]["state"] == "ready"


def test_inferctl_finds_the_daemon_from_a_config_file(daemon):
    by_flag = run(str(BIN / "inferctl"), "--config", str(daemon.config_path), "health")
    by_env = run(str(BIN / "inferctl"), "health", env={"INFERD_CONFIG": str(daemon.config_path)})
    assert by_flag.returncode == 0 and by_env.returncode == 0


def test_inferctl_reads_only_the_control_endpoint_from_a_config_file_being_edited(daemon, workdir):
    # Ahead of a SIGHUP: a version not copied yet, a key misspelt; inferctl must still reach the running daemon.
    config = tomllib.loads(daemon.config_path.read_text())
    config["models"]["mlp"]["version"] = "v9"
    config["queue"]["colour"] = "red"
    editing = workdir / "editing.toml"
    editing.write_text(to_toml(config))
    by_flag = run(str(BIN / "inferctl"), "--config", str(editing), "health")
    by_env = run(str(BIN / "inferctl"), "status", env={"INFERD_CONFIG": str(editing)})
    assert by_flag.returncode == 0 and by_env.returncode == 0, by_flag.stderr + by_env.stderr
    (workdir / "cut.toml").write_text("[server\n")
    (workdir / "nowhere.toml").write_text('[server]\ncontrol = "nowhere"\n')
    for name, says in (("cut.toml", "is not valid TOML"), ("nowhere.toml", "server.control: 'nowhere' is not an "
                                                                          "endpoint"), ("none.toml", "cannot read")):
        result = run(str(BIN / "inferctl"), "--config", str(workdir / name), "health")
        assert_one_sentence(result)
        assert says in result.stderr, result.stderr


def test_infer_writes_the_output_file(daemon, repo, workdir):
    x = np.random.default_rng(2).standard_normal((3, models.MLP_IN), dtype=np.float32)
    np.save(workdir / "x.npy", x)
    result = inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "x.npy"),
                      "--output", str(workdir / "y.npy"))
    assert result.returncode == 0, result.stderr
    assert "mlp v2" in result.stdout
    expected = torch.jit.load(str(repo / "mlp" / "v2" / "model.pt"))(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.load(workdir / "y.npy"), expected, rtol=1e-5, atol=1e-6)


def test_infer_prints_the_output_without_a_file(daemon, workdir):
    np.save(workdir / "x.npy", np.zeros((1, models.MLP_IN), dtype=np.float32))
    result = inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "x.npy"))
    assert result.returncode == 0 and "output 0: float32 [1, 4]" in result.stdout


def test_infer_with_a_wrong_shape_is_one_sentence(daemon, workdir):
    np.save(workdir / "x.npy", np.zeros((1, 3), dtype=np.float32))
    result = inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "x.npy"))
    assert_one_sentence(result)
    assert "InvalidRequest: input 0 has shape [1, 3]; mlp takes [N, 16]" in result.stderr


def test_infer_with_an_unknown_model_is_one_sentence(daemon, workdir):
    np.save(workdir / "x.npy", np.zeros((1, 3), dtype=np.float32))
    result = inferctl(daemon, "infer", "--model", "nope", "--input", str(workdir / "x.npy"))
    assert_one_sentence(result)
    assert "unknown model 'nope'" in result.stderr


def test_usage_errors_are_one_sentence():
    assert_one_sentence(run(str(BIN / "inferctl"), "frobnicate"))
    assert_one_sentence(run(str(BIN / "inferctl"), "infer", "--model", "m"))


def test_operator_mistakes_are_one_sentence(daemon, workdir):
    (workdir / "empty.npy").write_bytes(b"")
    (workdir / "text.npy").write_text("1 2 3\n")
    np.savez(workdir / "arrays.npz", x=np.zeros(3))
    np.save(workdir / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(workdir / "cut.npy", np.zeros((100, 100), dtype=np.float32))
    (workdir / "cut.npy").write_bytes((workdir / "cut.npy").read_bytes()[:1000])
    blocked = workdir / "a-file"
    blocked.write_text("")
    good = workdir / "x.npy"
    np.save(good, np.zeros((1, models.MLP_IN), dtype=np.float32))
    not_npy = "is not a .npy file; save the input with numpy.save(path, array)"
    for result, says in [
        (run(str(BIN / "inferctl"), "--control", "foo://bar", "status"), "cannot connect to foo://bar"),
        (run(str(BIN / "inferctl"), "keygen", str(blocked / "keys")), "cannot write the keys"),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "empty.npy")), not_npy),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "text.npy")), not_npy),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "arrays.npz")), not_npy),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "objects.npy")),
         "objects.npy as an array (it holds Python objects); save a numeric array with numpy.save"),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(workdir / "cut.npy")),
         "cut.npy as an array ("),
        (inferctl(daemon, "infer", "--model", "mlp", "--input", str(good), "--output", str(blocked / "y.npy")),
         "cannot write"),
    ]:
        assert_one_sentence(result)
        assert says in result.stderr, result.stderr
        assert "allow_pickle" not in result.stderr, "numpy's advice to unpickle is not inferctl's"


@pytest.mark.parametrize("option, argv", [
    ("--timeout", ("--timeout", "nan", "status")),
    ("--timeout", ("--timeout", "inf", "status")),
    ("--timeout", ("--timeout", "1e10", "status")),
    ("--watch", ("stats", "--watch", "nan")),
    ("--watch", ("stats", "--watch", "inf")),
    ("--canary", ("reload", "--version", "v2", "--canary", "nan")),
    ("--shadow", ("reload", "--version", "v2", "--shadow", "nan")),
    ("--weight", ("canary", "--weight", "nan")),
    ("--promote-after", ("reload", "--version", "v2", "--canary", "5", "--promote-after", "inf")),
])
def test_a_number_that_is_not_finite_or_a_wait_past_a_day_is_refused_in_one_sentence(workdir, option, argv):
    # No daemon is needed: the option is refused before inferctl connects (NaN once went on to the daemon as
    # JSON null, infinity to an OverflowError).
    result = run(str(BIN / "inferctl"), "--control", f"ipc://{workdir}/none.sock", *argv)
    assert_one_sentence(result)
    assert f"Invalid value for '{option}'" in result.stderr, result.stderr


@pytest.mark.parametrize("option", ["--fragmentation-threshold", "--fragmentation-min-stranded"])
def test_inferd_fleet_refuses_a_number_that_is_not_finite_before_it_reaches_for_a_cluster(option):
    result = run(str(BIN / "inferd-fleet"), option, "nan")
    assert_one_sentence(result)
    assert f"Invalid value for '{option}'" in result.stderr, result.stderr
