"""Models as PyTorch ships them: TorchScript, torch.export programs and AOTInductor packages, served by
the real daemon and compared with the same files run in this process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import models
import numpy as np
import pytest
import torch
from conftest import MLP, module_daemon, wait_for
from test_reload import Traffic, inferctl

from inferd import config as config_module
from inferd.harness import to_toml
from inferd.models import model_files
from inferd.worker.runner import ModelError, ModelRunner

FORMATS = {"v1": "torchscript", "v2": "exported", "v3": "aoti"}


@pytest.fixture(scope="module")
def in_process(formats_repo: Path) -> dict[str, object]:
    """Each version of the formats repository, loaded in this process the way PyTorch documents."""
    folder = formats_repo / "mlp"
    return {
        "v1": torch.jit.load(str(folder / "v1" / "model.pt")),
        "v2": torch.export.load(str(folder / "v2" / "model.pt2")).module(),
        "v3": torch._inductor.aoti_load_package(str(folder / "v3" / "model.pt2")),
    }


# The module's daemon serves the formats repository's mlp three times over, one model per format, each live
# from the start, on two executors; `mlp` is the one its tests reload.
STARTS_WITH = {"mlp": "v3", "exported": "v2", "scripted": "v1"}


def package_for(device: str, formats_repo: Path, target: Path) -> None:
    """A copy of the AOTInductor package v3 whose metadata says it was compiled for `device`."""
    with zipfile.ZipFile(formats_repo / "mlp" / "v3" / "model.pt2") as source, \
            zipfile.ZipFile(target, "w") as copy:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("_metadata.json"):
                data = json.dumps({**json.loads(data), "AOTI_DEVICE_KEY": device}).encode()
            copy.writestr(item, data)


def program_from_a_newer_torch(formats_repo: Path, target: Path) -> None:
    """A copy of the exported program v2 as a later torch would write it: a schema this torch does not read."""
    with zipfile.ZipFile(formats_repo / "mlp" / "v2" / "model.pt2") as source, \
            zipfile.ZipFile(target, "w") as copy:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("models/model.json"):
                program = json.loads(data)
                program["schema_version"]["major"] += 1
                data = json.dumps({**program, "torch_version": "99.0.0"}).encode()
            copy.writestr(item, data)


def add_unservable_versions(formats_repo: Path, folder: Path) -> None:
    """Beside v1, v2 and v3: `gpu`, a package compiled for CUDA; `cut`, half a package; `foreign`, a zip archive of
    neither format; `newer`, a program exported by a later torch."""
    (folder / "newer").mkdir()
    program_from_a_newer_torch(formats_repo, folder / "newer" / "model.pt2")
    (folder / "gpu").mkdir()
    package_for("cuda", formats_repo, folder / "gpu" / "model.pt2")
    (folder / "cut").mkdir()
    whole = (formats_repo / "mlp" / "v3" / "model.pt2").read_bytes()
    (folder / "cut" / "model.pt2").write_bytes(whole[: len(whole) // 2])
    (folder / "foreign").mkdir()
    with zipfile.ZipFile(folder / "foreign" / "model.pt2", "w") as foreign:
        foreign.writestr("weights/archive.bin", b"not a model")


@pytest.fixture(scope="module")
def daemon(formats_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("formats-served")
    shutil.copytree(formats_repo, repo, dirs_exist_ok=True)
    add_unservable_versions(formats_repo, repo / "mlp")
    served = {model: {**MLP, "version": version, "repository": str(repo / "mlp")}
              for model, version in STARTS_WITH.items()}
    with module_daemon(repo, served) as started:
        yield started


def live_version(daemon) -> str:
    return daemon.status()["models"]["mlp"]["live_version"]


def test_every_format_is_served_from_a_fresh_start(daemon, in_process):
    x = np.random.default_rng(4).standard_normal((3, models.MLP_IN), dtype=np.float32)
    with daemon.client() as client, torch.inference_mode():
        for model, version in STARTS_WITH.items():
            np.testing.assert_allclose(client.infer(model, x), in_process[version](torch.from_numpy(x)).numpy(),
                                       rtol=1e-5, atol=1e-6)


def test_a_package_runs_on_one_executor_of_a_cpu_worker_where_torchscript_runs_on_both(daemon):
    # Its binding holds the GIL: the worker gives it one executor, on the threads of both (runner.AllCoresPackage).
    x = np.ones((1, models.MLP_IN), np.float32)

    def busiest_under_load(model: str, until: Callable[[int], bool]) -> int:
        most = 0
        with daemon.client() as client:
            for _ in range(20):
                futures = [client.submit(model, x) for _ in range(200)]
                while not all(future.done() for future in futures):
                    most = max(most, daemon.status()["workers"][0]["executors_busy"])
                for future in futures:
                    future.result()
                if until(most):
                    break
        return most

    assert busiest_under_load("scripted", lambda most: most == 2) == 2, "TorchScript ran on both executors"
    assert STARTS_WITH["mlp"] == live_version(daemon) == "v3"  # mlp v3 is the package
    assert busiest_under_load("mlp", lambda most: False) == 1


def test_reloads_between_every_format_under_load_drop_nothing(daemon, in_process):
    with Traffic(daemon, threads=4) as traffic:
        # From each format to each other one; the daemon started on v3.
        for version in ("v1", "v2", "v3", "v2", "v1", "v3"):
            assert daemon.call("reload", timeout=120, model="mlp", version=version)["version"] == version
            traffic.wait_for_more(40)
    traffic.check(in_process)  # every reply ok, equal to its own version's file run in this process
    assert {header["version"] for _, header, _, _ in traffic.records} == {"v1", "v2", "v3"}


def test_versions_name_each_format_and_where_a_package_was_compiled(daemon):
    result = inferctl(daemon, "versions", "--json")
    assert result.returncode == 0, result.stderr
    listed = {v["version"]: v for v in json.loads(result.stdout)["mlp"]}
    assert {version: listed[version]["format"] for version in FORMATS} == FORMATS
    assert listed["v3"]["made"]["device"] == "cpu" and listed["v1"]["made"] == {}
    assert listed["v2"]["made"] == {"torch_version": torch.__version__}
    table = inferctl(daemon, "versions").stdout.splitlines()
    assert any(" v3 " in line and "aoti" in line and "compiled for cpu" in line for line in table), table
    assert any(" v2 " in line and f"exported by torch {torch.__version__}" in line for line in table), table


def test_a_package_compiled_for_another_device_or_a_broken_one_is_refused_with_a_sentence(daemon, in_process):
    live = live_version(daemon)
    for version, says in (
        ("gpu", "is an AOTInductor package compiled for cuda, but this worker runs on cpu; compile it for cpu"),
        ("cut", "is not a TorchScript or torch.export archive"),
        ("foreign", "is a zip archive but neither TorchScript nor torch.export"),
        ("newer", f"was exported by torch 99.0.0, which this worker's torch {torch.__version__} cannot load ("),
    ):
        result = inferctl(daemon, "reload", "--model", "mlp", "--version", version)
        assert result.returncode == 1 and says in result.stderr, (version, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert live_version(daemon) == live
    with daemon.client() as client, torch.inference_mode():
        x = np.ones((2, models.MLP_IN), dtype=np.float32)
        np.testing.assert_allclose(client.infer("mlp", x), in_process[live](torch.from_numpy(x)).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_file_is_told_by_what_it_holds(formats_repo, tmp_path):
    folder = formats_repo / "mlp"
    assert model_files.inspect(folder / "v1" / "model.pt").format == model_files.TORCHSCRIPT
    assert model_files.inspect(folder / "v2" / "model.pt2").format == model_files.EXPORTED
    package = model_files.inspect(folder / "v3" / "model.pt2")
    assert package.format == model_files.AOTI and package.made["device"] == "cpu" and package.problem is None
    renamed = tmp_path / "model.pt"  # a package under TorchScript's name is still a package
    shutil.copy(folder / "v3" / "model.pt2", renamed)
    assert model_files.inspect(renamed).format == model_files.AOTI


def test_a_torchscript_version_is_logged_as_deprecated_once_with_the_command_that_converts_it(daemon):
    lines = [line for line in daemon.log().splitlines() if "TorchScript, which PyTorch has deprecated" in line]
    started = [line for line in lines if "scripted v1" in line]
    assert len(started) == 1 and "inferd convert" in started[0], lines
    # The other formats never are; mlp's v1, if a reload made it live, once.
    assert all("scripted v1" in line or "mlp v1" in line for line in lines), lines
    assert sum("mlp v1" in line for line in lines) <= 1, lines


def test_a_version_others_may_write_is_refused_unless_allowed(formats_repo, workdir, start_daemon):
    repo = workdir / "repo"
    shutil.copytree(formats_repo, repo)
    (repo / "mlp" / "v2").chmod(0o775)  # the folder: its group may put another file there
    (repo / "mlp" / "v3" / "model.pt2").chmod(0o646)  # the file: anyone may rewrite it
    model = {**MLP, "version": "v1", "repository": str(repo / "mlp")}
    daemon = start_daemon({"mlp": model})
    for version, where, who in (("v2", repo / "mlp" / "v2", "its group"), ("v3", repo / "mlp" / "v3" / "model.pt2",
                                                                            "others")):
        result = inferctl(daemon, "reload", "--version", version)
        assert result.returncode == 1, result.stdout
        assert f"{where} may be written by {who}, and a model file is code the worker runs; `chmod go-w {where}`, " \
               "or set models.mlp.allow_writable = true" in result.stderr, result.stderr
    config = dict(daemon.config)
    config["models"]["mlp"]["allow_writable"] = True
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP: applied" in daemon.log(), what="the SIGHUP applied")
    assert inferctl(daemon, "reload", "--version", "v3").returncode == 0
    assert daemon.status()["models"]["mlp"]["live_version"] == "v3"


# -- inferd convert --------------------------------------------------------------------------------------


def convert(config: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "inferd"), "convert", "--config", str(config), *argv],
                          capture_output=True, text=True, timeout=600)


def config_file(workdir: Path, served: dict) -> Path:
    path = workdir / "inferd.toml"
    path.write_text(to_toml({"models": served}))
    return path


def test_convert_makes_an_exported_version_of_torchscript_that_a_reload_checks_and_serves(repo, workdir,
                                                                                       start_daemon):
    copy = workdir / "repo"
    shutil.copytree(repo / "mlp", copy / "mlp")
    model = {**MLP, "version": "v1", "repository": str(copy / "mlp")}
    result = convert(config_file(workdir, {"mlp": model}), "--model", "mlp", "--from", "v1", "--to", "v1x",
                     "--format", "exported")
    assert result.returncode == 0, result.stderr
    steps = result.stdout.splitlines()
    assert all(line.startswith("[") and " s] " in line for line in steps), steps
    assert any("converting TorchScript to a torch.export program" in line for line in steps)
    assert any("checking v1x against v1 at batch sizes 1, 2, 16" in line for line in steps)
    assert steps[-1].endswith("`inferctl reload --model mlp --version v1x` puts it live")
    folder = copy / "mlp" / "v1x"
    assert sorted(p.name for p in folder.iterdir()) == ["example_input.npy", "expected_output.npy", "model.pt2"]
    assert model_files.inspect(folder / "model.pt2").format == model_files.EXPORTED
    x = np.load(folder / "example_input.npy")
    with torch.inference_mode():
        np.testing.assert_allclose(np.load(folder / "expected_output.npy"),
                                   torch.jit.load(str(copy / "mlp" / "v1" / "model.pt"))(torch.from_numpy(x)).numpy())
    daemon = start_daemon({"mlp": model})
    assert inferctl(daemon, "reload", "--version", "v1x").returncode == 0  # its canary is checked on the way
    x = np.random.default_rng(9).standard_normal((5, models.MLP_IN), dtype=np.float32)
    with daemon.client() as client, torch.inference_mode():
        np.testing.assert_allclose(client.infer("mlp", x), torch.jit.load(str(copy / "mlp" / "v1" / "model.pt"))(
            torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_convert_compiles_the_demos_model_with_aoti_and_it_answers_as_the_original(workdir):
    from inferd import demo

    demo.build_repository(workdir / "demo")
    model = {"repository": str(workdir / "demo" / "mlp"), "inputs": [{"dtype": "float32", "shape": [256]}],
             "max_batch_size": 32}
    result = convert(config_file(workdir, {"mlp": model}), "--model", "mlp", "--from", "v2", "--to", "v2-aoti",
                     "--format", "aoti")
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert any("compiling with AOTInductor for cpu" in line for line in result.stdout.splitlines())
    package = workdir / "demo" / "mlp" / "v2-aoti" / "model.pt2"
    assert model_files.inspect(package).format == model_files.AOTI
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((7, 256), dtype=np.float32))
    with torch.inference_mode():
        want = torch.export.load(str(workdir / "demo" / "mlp" / "v2" / "model.pt2")).module()(x)
        got = torch._inductor.aoti_load_package(str(package))(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def test_convert_names_what_blocks_a_conversion_and_writes_nothing(repo, workdir):
    copy = workdir / "repo"
    shutil.copytree(repo / "variable", copy / "variable")
    shutil.copytree(repo / "mlp", copy / "mlp")
    served = {"variable": {"repository": str(copy / "variable"), "inputs": [{"dtype": "float32", "shape": [2]}],
                           "max_batch_size": 4},
              "mlp": {**MLP, "repository": str(copy / "mlp")}}
    config = config_file(workdir, served)
    loop = convert(config, "--model", "variable", "--from", "v1", "--to", "v2", "--format", "exported")
    assert loop.returncode == 1 and len(loop.stderr.strip().splitlines()) == 1, loop.stderr
    assert "variable v1 cannot be converted from TorchScript: PyTorch's converter does not support prim::Loop; " \
           "export the model from its Python source with torch.export.export instead" in loop.stderr, loop.stderr
    assert sorted(p.name for p in (copy / "variable").iterdir()) == ["v1"], "nothing written"
    for argv, says in ((("--to", "v2"), f"{copy / 'mlp' / 'v2'} exists already; name another version with --to"),
                       (("--to", "../elsewhere"), "--to '../elsewhere' is not a version name"),
                       (("--to", "v9", "--model", "nope"), "has no model 'nope'"),
                       (("--to", "v9", "--device", "bogus"), "--device 'bogus' is not a device; say cpu or cuda:N"),
                       (("--to", "v9", "--device", "cuda:99"), "--device cuda:99: this machine has")):
        result = convert(config, "--model", "mlp", "--from", "v1", "--format", "exported", *argv)
        assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr, result.stderr


# -- batch buckets ---------------------------------------------------------------------------------------

SEES_BATCH = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 8, "batch_buckets": [4, 8],
              "warmup_batch_sizes": [1, 8]}


def test_a_batch_is_padded_to_its_bucket_and_the_padding_never_reaches_a_reply(start_daemon):
    daemon = start_daemon({"seesbatch": SEES_BATCH}, workers={"streams": 1})
    assert "warmed on batch sizes [4, 8]" in daemon.log()
    rng = np.random.default_rng(1)
    with daemon.client() as client:
        for samples, bucket in ((1, 4), (3, 4), (4, 4), (5, 8), (8, 8)):
            x = rng.standard_normal((samples, 2), dtype=np.float32)
            doubled, seen = client.infer("seesbatch", x)
            np.testing.assert_array_equal(doubled, x * 2)  # the request's own rows, none of the padding
            assert seen.shape == (samples, 1) and set(seen.ravel()) == {bucket}, (samples, seen)
        stats = daemon.call("stats")["models"]["seesbatch"]
    assert stats["samples"] == 1 + 3 + 4 + 5 + 8, "counted as the requests' samples, not the padded ones"


def test_an_aotinductor_package_is_refused_cuda_graphs_before_anything_is_captured(formats_repo):
    model = config_module.parse({"models": {"mlp": {**MLP, "batch_buckets": [1, 16], "cuda_graphs": True,
                                             "repository": str(formats_repo / "mlp")}}}).models["mlp"]

    def capture(device: torch.device) -> None:
        raise AssertionError("nothing is to be captured")

    runner = ModelRunner(torch.device("cpu"), capture=capture)
    with pytest.raises(ModelError, match="mlp v3 is an AOTInductor package, which inferd cannot capture in a CUDA "
                                         "graph; set cuda_graphs = false for this model"):
        runner.load("mlp", model, "v3")


@pytest.mark.parametrize("buckets, says", [
    ([4, 16], "batch_buckets: 16 is over max_batch_size (8)"),
    ([8, 4], "batch_buckets: list each size once, smallest first"),
])
def test_buckets_that_cannot_be_are_refused_by_check_config(workdir, buckets, says):
    config = config_file(workdir, {"seesbatch": {**SEES_BATCH, "batch_buckets": buckets,
                                                 "repository": str(workdir)}})
    result = subprocess.run([str(Path(sys.executable).parent / "inferd"), "check-config", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and says in result.stderr, result.stderr


# -- compile = "inductor" ----------------------------------------------------------------------------------


def test_an_exported_version_is_compiled_while_it_warms_and_a_restarted_worker_takes_it_from_the_cache(
        formats_repo, start_daemon, in_process, monkeypatch):
    # Without the suite's cache folder in the environment (an operator's setting, which the worker keeps), the
    # daemon uses its state folder's.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # Warmed at two batch sizes over 1, which one graph with a dynamic batch dim serves (a batch of 1 would be
    # a graph of its own: a compile's worth more of the suite's time).
    daemon = start_daemon({"mlp": {**MLP, "version": "v2", "compile": "inductor", "warmup_batch_sizes": [2, 16],
                                   "repository": str(formats_repo / "mlp")}}, workers={"streams": 1}, wait=False)
    daemon.wait_healthy(300)  # the compile is in the start: a small machine takes tens of seconds
    compiled = re.findall(r"compiled mlp v2 with inductor while it warmed up: (\d+) graph\(s\) compiled, (\d+) from "
                          r"the compile cache", daemon.log())
    assert len(compiled) == 1 and int(compiled[0][0]) > 0, daemon.log()[-2000:]
    assert any((Path(daemon.config["server"]["state_dir"]) / "compile-cache").iterdir())
    x = np.random.default_rng(6).standard_normal((5, models.MLP_IN), dtype=np.float32)

    def answers_like_the_file() -> None:
        with daemon.client() as client, torch.inference_mode():
            np.testing.assert_allclose(client.infer("mlp", x), in_process["v2"](torch.from_numpy(x)).numpy(),
                                       rtol=1e-5, atol=1e-6)

    answers_like_the_file()
    os.kill(daemon.status()["workers"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["workers"][0])["restarts"] == 1 and w["state"] == "ready", timeout=300,
             what="the replacement ready")
    again = re.findall(r"compiled mlp v2 with inductor while it warmed up: (\d+) graph\(s\) compiled, (\d+) from "
                       r"the compile cache", daemon.log())
    assert len(again) == 2 and again[1][0] == "0" and int(again[1][1]) == int(compiled[0][0]), again
    answers_like_the_file()
    # Stopped, not killed with its session at the test's end: inductor's compile workers then close their
    # semaphores (/dev/shm/sem.mp-*), which a SIGKILL of every process, their resource tracker too, leaves.
    assert daemon.stop() == 0
