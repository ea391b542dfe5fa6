"""The mistakes of a newcomer's first hour, each answered with one sentence that says the fix; and
`inferctl models`, which shows a model's contract and a request that runs as printed."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import urllib.request
from pathlib import Path

import models
import numpy as np
import pytest
import torch
from conftest import MLP, PAIR, Daemon, base_config, reference, wait_for
from test_cli import BIN, assert_one_sentence, inferctl, run

from inferd import config as config_module
from inferd.client import Client
from inferd.errors import InvalidRequest
from inferd.harness import SERVE, free_port, to_toml

MLP_V1 = {**MLP, "version": "v1"}


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository `mlp` of one good version and what people save by mistake."""
    root = tmp_path_factory.mktemp("mistakes")
    models.save_script(models.Mlp, root, "mlp", "v1", 1)
    torch.manual_seed(2)
    module = models.Mlp().eval()
    for version, write in {
        "pickled": lambda path: torch.save(module, path),
        "weights": lambda path: torch.save(module.state_dict(), path),
    }.items():
        (root / "mlp" / version).mkdir()
        write(root / "mlp" / version / "model.pt")
    (root / "mlp" / "static").mkdir()
    torch.export.save(torch.export.export(module, (torch.randn(4, models.MLP_IN),)),
                      str(root / "mlp" / "static" / "model.pt2"))
    # A torch.export archive under TorchScript's name: served by what it holds.
    (root / "mlp" / "misnamed").mkdir()
    torch.export.save(torch.export.export(module, (torch.randn(2, models.MLP_IN),),
                                          dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},)),
                      str(root / "mlp" / "misnamed" / "model.pt"))
    (root / "mlp" / "half").mkdir()
    return root


PICKLED = ("is a pickled models.Mlp written by torch.save(model), which inferd never unpickles (a pickle can run any "
           "code); save it with torch.export.save(torch.export.export(model, example, dynamic_shapes=...)) as "
           "model.pt2, or with torch.jit.save(torch.jit.script(model)) as model.pt")
WEIGHTS = "holds a state dict or checkpoint (weights without code, written by torch.save); load it into its module"
STATIC = ("was exported with a fixed batch size of 4 (input 'x'), but batches of up to 16 come; export it with a "
          "dynamic batch dim: torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim(\"batch\")},))")


@pytest.fixture(scope="module")
def daemon(mistakes: Path, tmp_path_factory: pytest.TempPathFactory):
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="inferd-f"))
    served = Daemon(path, base_config(path, mistakes, {"mlp": MLP_V1}))
    served.start()
    yield served
    served.kill_all()
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("version, says", [("pickled", PICKLED), ("weights", WEIGHTS), ("static", STATIC)])
def test_a_model_saved_the_wrong_way_is_refused_with_how_to_save_it(daemon, version, says):
    result = inferctl(daemon, "reload", "--version", version)
    assert_one_sentence(result)
    assert says in result.stderr, result.stderr
    assert "PytorchStreamReader" not in result.stderr and "Guard failed" not in result.stderr
    assert daemon.status()["models"]["mlp"]["live_version"] == "v1"


def test_a_model_file_is_read_by_what_it_holds_whatever_its_name(daemon, mistakes):
    result = inferctl(daemon, "reload", "--version", "misnamed")
    assert result.returncode == 0, result.stderr
    try:
        x = np.random.default_rng(3).standard_normal((5, models.MLP_IN), dtype=np.float32)
        with daemon.client() as client:
            got = client.infer("mlp", x)
        torch.manual_seed(2)
        expected = models.Mlp().eval()(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    finally:
        assert inferctl(daemon, "reload", "--version", "v1").returncode == 0


def test_check_config_names_every_problem_in_one_pass(workdir, mistakes):
    raw = base_config(workdir, mistakes, {
        "a": {**MLP, "repository": str(mistakes / "mlp"), "version": "pickled"},
        "b": {**MLP, "repository": str(mistakes / "mlp"), "version": "weights"},
        "c": {**MLP, "repository": str(workdir / "nowhere")},
    })
    raw["server"]["colour"] = "red"  # a bad key in [server] used to hide every repository problem
    path = workdir / "bad.toml"
    path.write_text(to_toml(raw))
    result = run(str(BIN / "inferd"), "check-config", "--config", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    for says in ("server.colour: unknown key", f"models.a: version 'pickled': {mistakes}/mlp/pickled/model.pt "
                 + PICKLED, "models.b: version 'weights'", WEIGHTS, f"models.c: the repository {workdir}/nowhere "
                 "does not exist", "has 4 problem(s)"):
        assert says in result.stderr, result.stderr


def test_relative_paths_in_a_config_are_read_from_its_folder(workdir, mistakes):
    folder = workdir / "etc"
    folder.mkdir()
    (folder / "models").symlink_to(mistakes)
    raw = base_config(workdir, mistakes, {"mlp": {**MLP_V1, "repository": "models/mlp"}})
    raw["server"]["state_dir"] = "state"
    path = folder / "inferd.toml"
    path.write_text(to_toml(raw))
    # As systemd starts it: from /.
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    loaded = config_module.load(path)
    assert loaded.models["mlp"].repository == str(folder / "models" / "mlp")
    assert loaded.server.state_dir == str(folder / "state")


def test_a_data_endpoint_in_use_names_its_config_key(workdir, repo):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        raw = base_config(workdir, repo, {"mlp": MLP}, server={"listen": [f"tcp://127.0.0.1:{port}"]})
        path = workdir / "inferd.toml"
        path.write_text(to_toml(raw))
        result = run(str(BIN / "inferd"), "serve", "--config", str(path), timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    sentence = f"cannot listen at tcp://127.0.0.1:{port} (Address already in use); change server.listen"
    assert f"ERROR inferd.supervisor: {sentence}" in result.stderr, result.stderr


# An `inferd` package in the folder the daemon is started from, whose import leaves a note and fails.
DECOY = """\
import os, pathlib
with open(pathlib.Path(__file__).parent.parent / "imported", "a") as note:
    note.write(f"{os.getpid()}\\n")
raise ImportError("the decoy inferd package of the current folder was imported")
"""


def http_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/health/ready", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("command", [(str(BIN / "inferd"), "serve"), SERVE], ids=["console-script", "harness"])
def test_a_daemon_started_above_a_folder_named_inferd_imports_nothing_from_it(workdir, repo, command):
    above = workdir / "above"  # the folder above a clone named `inferd`
    (above / "inferd").mkdir(parents=True)
    (above / "inferd" / "__init__.py").write_text(DECOY)
    http = f"127.0.0.1:{free_port()}"
    daemon = Daemon(workdir, base_config(workdir, repo, {"mlp": MLP}, server={"http": http}), command=command,
                    cwd=above)
    try:
        daemon.start()
        x = np.random.default_rng(5).standard_normal((3, models.MLP_IN), dtype=np.float32)
        with daemon.client() as client:
            np.testing.assert_allclose(client.infer("mlp", x), reference(repo, "mlp", "v2")(x), rtol=1e-5,
                                       atol=1e-6)
        wait_for(lambda: http_ready(http), what="the HTTP gateway ready")
    finally:
        daemon.kill_all()
    note = above / "imported"
    assert not note.exists(), f"processes {note.read_text().split()} imported the decoy package"


def test_inferctl_without_a_daemon_says_how_to_point_it_at_one(workdir):
    hint = ("start one with `inferd serve`, or point inferctl at yours with --config PATH, $INFERD_CONFIG or "
            "--control ADDR")
    told = run(str(BIN / "inferctl"), "--control", f"ipc://{workdir}/none.sock", "status")
    # Told nothing, it looks where a daemon of this user would be (XDG_RUNTIME_DIR); there is none.
    searched = run(str(BIN / "inferctl"), "status", env={"XDG_RUNTIME_DIR": str(workdir), "INFERD_CONFIG": ""})
    for result in (told, searched):
        assert_one_sentence(result)
        assert "no daemon is listening at ipc://" in result.stderr and hint in result.stderr, result.stderr


def test_the_client_refuses_a_request_over_the_message_limit_before_sending_it(start_daemon):
    daemon = start_daemon({"mlp": {**MLP, "max_batch_size": 1024}}, server={"max_message_mb": 0.05})
    big = np.zeros((1000, models.MLP_IN), dtype=np.float32)  # 0.06 MiB
    with Client(daemon.endpoint, max_message_mb=0.05) as client:
        with pytest.raises(InvalidRequest, match=r"the request holds 0\.1 MiB of inputs, over the daemon's limit "
                                                 r"of 0\.05 MiB \(server\.max_message_mb\); send fewer samples"):
            client.infer("mlp", big)
        assert client.infer("mlp", big[:500]).shape == (500, models.MLP_OUT)
    replies = daemon.call("status")["replies"]
    assert replies == {"ok": 1}, "the refused request never reached the daemon"


def test_inferctl_models_shows_the_contract_and_a_request_that_runs_as_printed(daemon, mistakes, workdir):
    found = json.loads(inferctl(daemon, "models", "--json").stdout)["mlp"]
    assert found["config"]["inputs"] == [{"dtype": "float32", "shape": [models.MLP_IN], "name": None,
                                         "max_shape": None, "pad_value": None}]
    assert found["outputs"] == [["float32", [models.MLP_OUT]]]
    # "config" unless a test of this module reloaded it before (each reload ends back on v1).
    origin = "config" if daemon.status()["models"]["mlp"]["previous_version"] is None else "reload"
    assert found["live_version"] == "v1" and found["live_from"] == origin
    assert found["config"]["max_batch_size"] == 16
    on_disk = {entry["version"]: entry for entry in found["on_disk"]}
    assert set(on_disk) == {"v1", "pickled", "weights", "static", "misnamed", "half"}
    assert on_disk["v1"]["format"] == "torchscript" and on_disk["v1"]["problem"] is None
    assert on_disk["static"]["format"] == "exported" and on_disk["misnamed"]["format"] == "exported"
    assert PICKLED in on_disk["pickled"]["problem"] and WEIGHTS in on_disk["weights"]["problem"]
    assert on_disk["half"]["problem"] == "the folder holds no model.py, model.pt or model.pt2"

    text = inferctl(daemon, "models")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"mlp: live v1 (from {'the config' if origin == 'config' else 'a reload'}; the config says 'v1')"
    assert "  batches of up to 16 samples; a partial batch waits up to 2 ms (max_wait_ms)" in lines
    assert f"  input  INPUT__0         float32 [N, {models.MLP_IN}]" in lines
    assert f"  output OUTPUT__0        float32 [N, {models.MLP_OUT}]" in lines
    assert any(line.startswith("  * v1 ") and "torchscript" in line and "(live)" in line for line in lines)
    assert any(line.startswith("    pickled ") and "cannot be served: " in line for line in lines)
    commands = lines[lines.index("  try it:") + 1:]
    assert len(commands) == 3
    env = {"PATH": f"{BIN}:/usr/bin:/bin"}
    outputs = []
    for command in commands:
        argv = shlex.split(command.strip())
        if argv[0] == "inferctl":
            argv[1:1] = ["--control", daemon.control]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=workdir, env=env)
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done.stdout)
    assert "mlp v1: 1 output(s)" in outputs[1] and "[[" in outputs[2], outputs
    wait_for(lambda: daemon.call("status")["replies"].get("ok", 0) >= 2, what="both example requests answered")


def test_stats_say_dash_where_there_is_no_figure(start_daemon):
    daemon = start_daemon({"mlp": MLP, "pair": PAIR})
    with daemon.client() as client:
        client.infer("mlp", np.zeros((2, models.MLP_IN), dtype=np.float32))
    table = inferctl(daemon, "stats").stdout
    rows = {line.split()[0]: line.split() for line in table.splitlines()
            if line.startswith(("mlp ", "pair ")) and line.split()[1] == "all"}
    # model, version, requests, not ok, samples, then p50, p99, queue p99, compute p99, samples/s, goodput/s, batch
    assert rows["pair"][2:5] == ["0", "0", "0"] and rows["pair"][5:9] == ["-"] * 4 and rows["pair"][11] == "-"
    assert rows["mlp"][2:5] == ["1", "0", "2"] and float(rows["mlp"][5]) > 0 and float(rows["mlp"][11]) == 2.0
    assert "admission: no estimate for pair yet (it has computed nothing)" in table
    assert "not known yet" not in table
