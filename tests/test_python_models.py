"""Python models (model.py): served by processes of their own (steps), supervised as workers are, answering
each request of a batch alone where one raises, and never importing torch."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import models
import numpy as np
import pytest
from conftest import (
    MLP,
    RELOAD_MLP,
    Daemon,
    base_config,
    exited,
    gated_reload_repo,
    module_daemon,
    sent_while_held,
    wait_for,
)
from gates import Gate
from python_models import (
    GATE,
    HANG,
    MEANPOOL_CONFIG,
    QUIT,
    RELAY_CONFIG,
    SCALE_CONFIG,
    SCALE_FEATURES,
    gated,
    in_process,
    write,
)
from wire import RawPeer

from inferd import RetryPolicy
from inferd.errors import InferenceError, InvalidRequest
from inferd.harness import free_port, local_config, to_toml
from inferd.ipc.arena import arena_name
from inferd.ipc.control import ControlError
from inferd.system.shm_names import ARENA_PREFIX, SHM_DIR

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def scale(gates: Path, **overrides: Any) -> dict[str, Any]:
    """The scale model's config: its gates in `gates`, its factor 2."""
    return {**SCALE_CONFIG, "version": "v1", "parameters": {"factor": 2.0, "gates": str(gates)}, **overrides}


def steps_of(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    return [w for w in daemon.status()["workers"] if w["kind"] == "step" and w["model"] == model]


@pytest.fixture(scope="module")
def served(python_repo: Path, repo: Path) -> Iterator[Daemon]:
    """One daemon for the module: scale (two processes), scale_one (the same model, one process) and mlp, a tensor
    model, beside them; over the Open Inference Protocol's HTTP too."""
    def gated(config: dict[str, Any], folder: Path) -> None:
        (folder / "gates").mkdir()
        config["models"]["scale"].update(scale(folder / "gates", processes=2))
        config["models"]["scale_one"].update(scale(folder / "gates"))

    with module_daemon(python_repo, {"scale": {}, "scale_one": {"repository": str(python_repo / "scale")},
                                     "mlp": {**MLP, "repository": str(repo / "mlp")}},
                       gated, server={"http": f"127.0.0.1:{free_port()}"}) as daemon:
        yield daemon


def test_a_python_model_answers_as_its_model_py_does_in_process(served, python_repo):
    reference = in_process(python_repo / "scale" / "v1", {"factor": 2.0})
    rng = np.random.default_rng(5)
    with served.client() as client:
        for samples in (1, 3, 8):
            x = rng.uniform(0, 10, (samples, SCALE_FEATURES)).astype(np.float32)
            scaled, total = client.infer("scale", x)
            expected = reference({"x": x})
            np.testing.assert_array_equal(scaled, expected["scaled"])
            np.testing.assert_array_equal(total, expected["total"])
            assert scaled.dtype == np.float32 and total.dtype == np.float64 and total.shape == (samples, 1)
        assert client.infer("mlp", np.ones((1, 16), np.float32)).shape == (1, 4), "the tensor model beside it"


def test_over_the_open_inference_protocol_its_tensors_have_the_names_and_dtypes_its_config_declares(served):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    oip = httpclient.InferenceServerClient(served.config["server"]["http"])
    metadata = oip.get_model_metadata("scale")
    assert metadata["platform"] == "python" and oip.get_model_config("scale")["backend"] == "python"
    assert oip.get_model_metadata("mlp")["platform"] == "pytorch_libtorch", "a tensor model beside it keeps its own"
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("scaled", "FP32", [-1, SCALE_FEATURES]), ("total", "FP64", [-1, 1])]
    x = np.arange(2 * SCALE_FEATURES, dtype=np.float32).reshape(2, SCALE_FEATURES)
    given = httpclient.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    answer = oip.infer("scale", [given])
    np.testing.assert_array_equal(answer.as_numpy("scaled"), x * 2)
    np.testing.assert_array_equal(answer.as_numpy("total"), x.astype(np.float64).sum(axis=1, keepdims=True))
    given.set_data_from_numpy(-x)
    with pytest.raises(InferenceServerException, match="scale v1: InvalidInput: negative values") as refused:
        oip.infer("scale", [given])
    assert refused.value.status() == "400"


def test_its_processes_are_listed_titled_and_never_load_torch(served):
    steps = steps_of(served, "scale")
    assert [(s["number"], s["name"], s["state"], s["generation"], s["restarts"]) for s in steps] == [
        (0, "step scale.0", "ready", 1, 0), (1, "step scale.1", "ready", 1, 0)]
    workers = [w for w in served.status()["workers"] if w["kind"] == "worker"]
    assert [w["loaded"] for w in workers] == [["mlp v2"]], "the tensor model on the worker, scale on its steps"
    assert all(s["loaded"] == ["scale v1"] for s in steps)
    for step in steps:
        assert open(f"/proc/{step['pid']}/cmdline").read().startswith(f"inferd: step scale.{step['number']}")
        maps = open(f"/proc/{step['pid']}/maps").read()
        assert "libtorch" not in maps and "numpy" in maps
    assert "libtorch" in open(f"/proc/{workers[0]['pid']}/maps").read()


def test_stacks_shows_where_its_processes_are_asked_or_signalled(served):
    pids = {s["number"]: s["pid"] for s in steps_of(served, "scale")}
    stacks = served.call("stacks", timeout=10)["workers"]
    assert "_serve_control" in stacks[f"step scale.0 (pid {pids[0]})"], "the step's main thread, from its own stacks"
    # A daemon whose control socket does not answer: inferctl signals the processes it finds by their titles.
    result = subprocess.run([str(BIN / "inferctl"), "--control", served.control, "--timeout", "0.000001", "stacks"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"== step scale.1 (pid {pids[1]})" in result.stdout and "_serve_control" in \
        result.stdout.partition(f"== step scale.1 (pid {pids[1]})")[2]


def test_one_bad_request_of_a_batch_fails_alone_with_its_own_status(served):
    gates = Path(served.config["models"]["scale_one"]["parameters"]["gates"])
    good = [np.full((1, SCALE_FEATURES), value, np.float32) for value in (1, 2, 3)]
    invalid = np.array([[1, -3, 2, 2]], np.float32)
    out_of_range = np.array([[1, 2, 3, 5000]], np.float32)
    sent = [good[0], invalid, good[1], out_of_range, good[2]]
    before = served.call("stats")["models"]["scale_one"]["batch_size"]["distribution"]
    replies = sent_while_held(served, "scale_one", sent, lambda gate, rows: gated(gate.number, rows=rows), gates)
    after = served.call("stats")["models"]["scale_one"]["batch_size"]["distribution"]
    assert after.get("5", 0) == before.get("5", 0) + 1, "the five went as one batch"
    reference = in_process(Path(served.config["models"]["scale_one"]["repository"]) / "v1", {"factor": 2.0})
    for index in (0, 2, 4):
        header, (scaled, total) = replies[index]
        assert header["status"] == "ok", header
        np.testing.assert_array_equal(scaled, reference({"x": sent[index]})["scaled"])
    header, _ = replies[1]
    assert (header["status"], header["error"]) == ("invalid", "scale_one v1: InvalidInput: negative values are "
                                                              "refused: [-3.0]")
    header, _ = replies[3]
    assert (header["status"], header["error"]) == ("internal", "scale_one v1: ValueError: values over 1000 are out "
                                                               "of this model's range")
    with served.client(retry=RetryPolicy(max_attempts=1)) as client, pytest.raises(InvalidRequest) as refused:
        client.infer("scale_one", invalid)
    assert refused.value.status == "invalid" and "negative values are refused" in refused.value.message


def test_a_model_that_raises_what_is_not_an_exception_fails_its_batch_with_a_sentence_and_serves_on(served):
    x = np.ones((1, SCALE_FEATURES), np.float32)
    with RawPeer(served.endpoint) as peer:
        for number, raised in enumerate(("SystemExit: 1", "KeyboardInterrupt: (no message)", "BaseException: base")):
            quits = np.array([[QUIT, number, 0, 0]], np.float32)
            peer.send(number, "scale_one", [quits], timeout_ms=5000)
            header, _ = peer.recv(timeout=10)
            assert (header["status"], header["error"]) == ("internal", f"scale_one v1: {raised}")
            peer.send("after", "scale_one", [x], timeout_ms=5000)
            header, (scaled, _) = peer.recv(timeout=10)
            assert header["status"] == "ok", "the step's executor serves on"
            np.testing.assert_array_equal(scaled, x * 2)
    with pytest.raises(ControlError, match="refused scale_one exits: scale_one exits: Model\\(\\) raised SystemExit: "
                                           "0; v1 keeps serving"):
        served.call("reload", timeout=60, model="scale_one", version="exits")
    assert steps_of(served, "scale_one")[0]["loaded"] == ["scale_one v1"]


def test_a_model_that_changed_its_inputs_in_place_and_raised_runs_each_request_again_on_what_it_sent(
        start_daemon, python_repo, workdir):
    (workdir / "gates").mkdir()
    daemon = start_daemon({"double_in_place": {**RELAY_CONFIG, "max_batch_size": 8, "max_wait_ms": 0,
                                               "repository": str(python_repo / "double_in_place"),
                                               "parameters": {"gates": str(workdir / "gates")}}})
    sent = [np.array([[value, 1]], np.float32) for value in (1, 13, 3)]
    replies = sent_while_held(daemon, "double_in_place", sent,
                              lambda gate, rows: np.array([[GATE, gate.number]] * rows, np.float32), workdir / "gates")
    assert "running each request alone" in daemon.log(), "the three went as one batch, which raised"
    for index in (0, 2):
        header, (y,) = replies[index]
        assert header["status"] == "ok", header
        np.testing.assert_array_equal(y, sent[index] * 2)
    header, _ = replies[1]
    assert (header["status"], header["error"]) == (
        "internal", "double_in_place v1: ValueError: a sample whose first value is 13 is refused")


def test_a_reload_of_a_python_model_is_blue_green_and_names_its_outputs(served):
    closed = Path(served.config["models"]["scale_one"]["parameters"]["gates"]) / "closed"
    x = np.full((2, SCALE_FEATURES), 3, np.float32)
    with served.client() as client:
        np.testing.assert_array_equal(client.infer("scale_one", x)[0], x * 2)
        result = served.call("reload", timeout=60, model="scale_one", version="v2")
        assert result["version"] == "v2" and result["previous"] == "v1"
        np.testing.assert_array_equal(client.infer("scale_one", x)[0], x * 10)
        wait_for(lambda: closed.exists() and closed.read_text().split() == ["v1"], what="v1's close() called")
        with pytest.raises(ControlError, match="does not reproduce expected_output.npy"):
            served.call("reload", timeout=60, model="scale_one", version="bad_canary")
        with pytest.raises(ControlError, match="^cannot reload scale_one: scale_one tensor is a tensor model \\(a file "
                                               "torch saved\\), but scale_one is served as a Python model"):
            served.call("reload", timeout=60, model="scale_one", version="tensor")
        listed = served.call("models", model="scale_one")["scale_one"]
        assert listed["outputs"] == [["float32", [SCALE_FEATURES]], ["float64", [1]]] and listed["ready"]
        served.call("reload", timeout=60, model="scale_one", version="v1")
        np.testing.assert_array_equal(client.infer("scale_one", x)[0], x * 2)
    assert steps_of(served, "scale_one")[0]["loaded"] == ["scale_one v1"], "v2 unloaded once its last batch was back"


def test_a_canary_of_a_python_model_takes_its_share_and_versions_and_stats_show_both(served):
    served.call("reload", timeout=60, model="scale_one", version="v2", canary=50)
    x = np.ones((1, SCALE_FEATURES), np.float32)
    with served.client() as client:
        factors = {float(client.infer("scale_one", x)[0][0, 0]) for _ in range(60)}
        assert factors == {2.0, 10.0}, "v1 and its canary v2 both answered"
        served.call("promote", timeout=60, model="scale_one")
        assert float(client.infer("scale_one", x)[0][0, 0]) == 10.0
        served.call("reload", timeout=60, model="scale_one", version="v1")
    stats = served.call("stats")["models"]["scale_one"]
    assert stats["versions"]["v1"]["requests"]["ok"] > 0 and stats["versions"]["v2"]["requests"]["ok"] > 0
    versions = served.call("versions", model="scale_one")["scale_one"]
    assert [(v["version"], v["file"], v["format"], v["live"]) for v in versions] == [
        ("bad_canary", "model.py", "python", False), ("exits", "model.py", "python", False),
        ("tensor", "model.pt", "torchscript", False),
        ("v1", "model.py", "python", True), ("v2", "model.py", "python", False)]


def test_a_shadow_of_a_python_model_is_computed_beside_it_and_compared(served):
    served.call("reload", timeout=60, model="scale_one", version="v2", shadow=100)
    x = np.ones((1, SCALE_FEATURES), np.float32)
    with served.client() as client:
        for _ in range(20):
            np.testing.assert_array_equal(client.infer("scale_one", x)[0], x * 2)  # clients get the live replies

    def compared() -> dict[str, Any] | None:
        shadow = served.call("stats")["models"]["scale_one"]["shadow"].get("v2")
        return shadow if shadow and shadow["compared"] >= 10 else None

    shadow = wait_for(compared, what="the shadow's batches compared")
    assert shadow["allclose_share"] == 0.0 and shadow["max_abs_difference"] == 8.0, "v2 answers 10x, v1 2x"
    served.call("rollback", timeout=60, model="scale_one")


def test_a_step_killed_under_load_is_restarted_and_every_request_is_answered(served):
    before = {s["number"]: s for s in steps_of(served, "scale")}
    rng = np.random.default_rng(11)
    inputs = [rng.uniform(0, 10, (int(rng.integers(1, 4)), SCALE_FEATURES)).astype(np.float32) for _ in range(3000)]
    answers: list[Any] = []
    killed = False
    with served.client() as client:
        window: list[Any] = []
        for x in inputs:
            window.append(client.submit("scale", x))
            if len(window) == 64:  # 64 in flight, as 64 clients would keep
                answers.append(window.pop(0).result())
            if len(answers) == 500 and not killed:
                os.kill(before[0]["pid"], signal.SIGKILL)
                killed = True
        answers += [future.result() for future in window]
    assert killed and len(answers) == len(inputs), "every request was answered"
    for x, (scaled, total) in zip(inputs, answers):
        np.testing.assert_array_equal(scaled, x * 2)
        np.testing.assert_array_equal(total, x.astype(np.float64).sum(axis=1, keepdims=True))
    wait_for(lambda: exited(before[0]["pid"]), what="the killed step gone")
    back = wait_for(lambda: next((s for s in steps_of(served, "scale") if s["number"] == 0 and s["state"] == "ready"
                                  and s["pid"] != before[0]["pid"]), None), what="step scale.0 back")
    assert back["restarts"] == 1 and back["generation"] == 2
    assert steps_of(served, "scale")[1]["pid"] == before[1]["pid"], "the other step served on"
    assert "step scale.0 (ready) died: killed by signal 9" in served.log()


def test_a_step_that_hangs_is_ended_and_restarted(start_daemon, python_repo):
    daemon = start_daemon({"scale": scale(Path("/nonexistent"), repository=str(python_repo / "scale"))},
                          workers={"batch_timeout_s": 1})
    (step,) = steps_of(daemon, "scale")
    with RawPeer(daemon.endpoint) as peer:
        peer.send("hangs", "scale", [np.full((1, SCALE_FEATURES), HANG, np.float32)], timeout_ms=500)
        header, _ = peer.recv(timeout=10)
        assert header["status"] == "timeout", "a step past its deadline is not waited for"
    back = wait_for(lambda: next((s for s in steps_of(daemon, "scale") if s["state"] == "ready"
                                  and s["pid"] != step["pid"]), None), what="the step restarted", timeout=60)
    assert back["restarts"] == 1 and exited(step["pid"])
    assert "step scale.0 is hung: batch" in daemon.log() and "ran longer than workers.batch_timeout_s (1 s)" in \
        daemon.log()
    x = np.ones((1, SCALE_FEATURES), np.float32)
    with daemon.client() as client:
        np.testing.assert_array_equal(client.infer("scale", x)[0], x * 2)


def test_a_python_model_whose_answer_padding_changes_is_refused_at_load_as_a_tensor_model_is(start_daemon,
                                                                                              python_repo):
    daemon = start_daemon({"meanpool": {**MEANPOOL_CONFIG, "version": "masked",
                                        "repository": str(python_repo / "meanpool")}})
    with daemon.client() as client:
        mean, y = client.infer("meanpool", np.array([[1, 2]], np.float32))
        assert mean.tolist() == [[1.5]] and y.tolist() == [[2, 4]]
    with pytest.raises(ControlError, match=re.escape("refused meanpool unmasked: padding changes the answer of "
                                                     "meanpool unmasked: output 0 (mean) of a sample made for the "
                                                     "check (x [4]) differs by up to")):
        daemon.call("reload", timeout=60, model="meanpool", version="unmasked")


def test_what_a_python_models_process_started_ends_with_it_when_it_crashes_and_when_the_supervisor_is_killed(
        start_daemon, python_repo, workdir):
    helpers = workdir / "helpers"
    helpers.mkdir()
    daemon = start_daemon({"with_helper": {**RELAY_CONFIG, "repository": str(python_repo / "with_helper"),
                                           "parameters": {"helpers": str(helpers)}}})

    def started() -> dict[str, int]:
        return {path.name: int(path.read_text()) for path in helpers.glob("helper-*") if path.read_text()}

    (first,) = started().values()
    with RawPeer(daemon.endpoint) as peer:
        peer.send("crash", "with_helper", [-np.ones((1, 2), np.float32)], timeout_ms=60_000)
        assert peer.recv(timeout=60)[0]["status"] != "ok"
    wait_for(lambda: exited(first), what="the helper of the step that crashed gone")
    step = wait_for(lambda: next((s for s in steps_of(daemon, "with_helper") if s["state"] == "ready"), None),
                    what="the step restarted")
    now = started()[f"helper-{step['pid']}"]
    assert not exited(now)
    os.kill(daemon.process.pid, signal.SIGKILL)
    wait_for(lambda: exited(now), what="the helper of the step whose supervisor was killed gone")
    wait_for(lambda: exited(step["pid"]), what="the step gone")


def test_a_sighup_that_raises_its_processes_starts_them_and_one_that_lowers_them_waits_for_a_restart(
        start_daemon, python_repo, workdir):
    (workdir / "gates").mkdir()
    daemon = start_daemon({"scale": scale(workdir / "gates", repository=str(python_repo / "scale"))})
    (first,) = steps_of(daemon, "scale")

    def sighup(processes: int) -> None:
        handled = daemon.log().count("SIGHUP: applied")
        config = copy.deepcopy(daemon.config)
        config["models"]["scale"]["processes"] = processes
        daemon.config_path.write_text(to_toml(config))
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: daemon.log().count("SIGHUP: applied") > handled, what="the SIGHUP applied")

    sighup(3)
    assert "SIGHUP: applied models.scale.processes 1 -> 3" in daemon.log()
    wait_for(lambda: [w["state"] for w in steps_of(daemon, "scale")] == ["ready"] * 3, what="two processes more")
    steps = steps_of(daemon, "scale")
    assert steps[0]["pid"] == first["pid"] and [w["number"] for w in steps] == [0, 1, 2]
    gates = [Gate(workdir / "gates") for _ in range(3)]
    with RawPeer(daemon.endpoint) as peer:
        try:
            for running, gate in enumerate(gates, 1):  # one at a time: requests sent together batch together
                peer.send(gate.number, "scale", [gated(gate.number)], timeout_ms=60_000)
                wait_for(lambda n=running: sum(w["executors_busy"] for w in steps_of(daemon, "scale")) == n,
                         what=f"{running} batch(es) running")
            assert [w["executors_busy"] for w in steps_of(daemon, "scale")] == [1, 1, 1]
        finally:
            for gate in gates:
                gate.open()
        assert sorted(peer.recv(timeout=30)[0]["status"] for _ in gates) == ["ok"] * 3
    sighup(2)
    assert "need a restart and were not applied: models.scale.processes 3 -> 2" in daemon.log()
    assert len(steps_of(daemon, "scale")) == 3


def test_check_config_refuses_a_python_model_without_outputs_and_python_keys_on_a_tensor_model(tmp_path, python_repo,
                                                                                               repo):
    models = {"scale": {"repository": str(python_repo / "scale"), "version": "v1",
                        "inputs": SCALE_CONFIG["inputs"], "outputs": [{"name": "scaled"}]},
              "mlp": {**MLP, "repository": str(repo / "mlp"), "processes": 2}}
    path = tmp_path / "inferd.toml"
    path.write_text(to_toml(local_config(tmp_path, models)))
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("models.scale.outputs: a Python model (model.py) lists its outputs, each with its dtype and per-sample "
            "shape") in result.stderr
    assert ("models.mlp.processes: processes is for a Python model (a version folder holding model.py), and this "
            "one is a tensor model; remove it") in result.stderr
    models["scale"]["outputs"] = SCALE_CONFIG["outputs"]
    del models["mlp"]["processes"]
    path.write_text(to_toml(local_config(tmp_path, models)))
    result = subprocess.run([str(BIN / "inferd"), "convert", "--config", str(path), "--model", "scale", "--from", "v1",
                             "--to", "v9"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().endswith(
        "model.py is a Python model, which runs as it is: there is nothing to convert"), result.stderr


def test_an_interpreter_that_cannot_be_started_gives_its_steps_up_and_the_daemon_serves_the_rest(start_daemon,
                                                                                                   python_repo, repo,
                                                                                                   workdir):
    broken = workdir / "python"
    broken.write_text("#!/nowhere/bin/python3\n")  # executable, so the config passes, but exec fails
    broken.chmod(0o755)
    daemon = start_daemon({"scale": scale(Path("/nonexistent"), repository=str(python_repo / "scale"),
                                          python=str(broken)),
                           "mlp": {**MLP, "repository": str(repo / "mlp")}}, wait=False)
    wait_for(lambda: "serving without step scale.0, which failed to start" in daemon.log(), timeout=120,
             what="the daemon serving without the step")
    (step,) = steps_of(daemon, "scale")
    assert step["state"] == "failed" and step["pid"] is None
    assert step["last_error"].startswith("its process could not be started: [Errno 2] No such file or directory")
    assert daemon.call("health") == {"healthy": False, "reason": "no ready worker serves scale v1"}
    daemon.endpoint = daemon.status()["listen"][0]  # the port it picked (start waits for health, which is false)
    with daemon.client() as client:
        assert client.infer("mlp", np.ones((1, 16), np.float32)).shape == (1, 4)


# float32 [2] -> "big" float32 [2] (x * 1e37, computed in float64) and "count" int8 [2] (x * 100, in int64).
OVERFLOWS = """
import numpy as np


class Model:
    def __call__(self, inputs):
        x = inputs["x"].astype(np.float64)
        return {"big": x * 1e37, "count": (x * 100).astype(np.int64)}
"""


def test_an_output_cast_to_its_declared_dtype_that_would_lose_values_fails_its_request(start_daemon, workdir):
    # numpy casts float64 1e39 to float32 inf and int64 150 to int8 -106, silently: answers no one asked for.
    write(workdir / "python", "overflows", "v1", OVERFLOWS)
    daemon = start_daemon({"overflows": {
        "repository": str(workdir / "python" / "overflows"), "max_batch_size": 1,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
        "outputs": [{"name": "big", "dtype": "float32", "shape": [2]},
                    {"name": "count", "dtype": "int8", "shape": [2]}]}})
    with daemon.client() as client:
        big, count = client.infer("overflows", np.array([[0, 1]], np.float32))
        np.testing.assert_allclose(big, [[0, 1e37]], rtol=1e-6)
        assert count.tolist() == [[0, 100]]
        for x, output in (([0, 100], "'big' is float64"), ([0, 1.5], "'count' is int64")):
            with pytest.raises(InferenceError, match=f"output {output} with values that") as refused:
                client.infer("overflows", np.array([x], np.float32))
            assert refused.value.status == "internal"


def test_a_daemon_none_of_whose_models_can_start_stops_its_start_with_why(start_daemon, workdir):
    # Its one model is a Python model: the worker that would hold tensor models is ready with none to serve.
    write(workdir / "python", "broken", "v1", "class Model:\n    def __init__(self):\n        raise ValueError('no')\n")
    daemon = start_daemon({"broken": {**SCALE_CONFIG, "repository": str(workdir / "python" / "broken")}}, wait=False)
    assert daemon.wait(120) == 1
    assert "no model could start: broken v1: Model() raised ValueError: no" in daemon.log()


@pytest.mark.serial
def test_a_python_model_runs_under_an_interpreter_of_its_own_that_has_no_torch(start_daemon, python_repo, tmp_path):
    # The interpreter as docs/models.md makes it: a venv holding inferd (without its dependencies) and what the
    # inferd[step] extra names, nothing else.
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    own = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=own)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["step"]
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *extra], check=True, timeout=300, env=own, capture_output=True)
    subprocess.run([*pip, "--no-deps", str(ROOT)], check=True, timeout=300, env=own, capture_output=True)
    assert subprocess.run([python, "-c", "import torch"], env=own, capture_output=True).returncode != 0

    daemon = start_daemon({"scale": scale(Path("/nonexistent"), repository=str(python_repo / "scale"),
                                          python=python)})
    (step,) = steps_of(daemon, "scale")
    maps = open(f"/proc/{step['pid']}/maps").read()
    assert f"{venv}/lib" in maps and "libtorch" not in maps, "numpy from the venv, and no torch"
    assert sys.prefix not in maps, "nothing of the daemon's own environment"
    x = np.arange(2 * SCALE_FEATURES, dtype=np.float32).reshape(2, SCALE_FEATURES)
    with daemon.client() as client:
        scaled, total = client.infer("scale", x)
    np.testing.assert_array_equal(scaled, x * 2)
    np.testing.assert_array_equal(total, x.astype(np.float64).sum(axis=1, keepdims=True))


def test_the_example_of_the_models_page_serves_as_written(workdir):
    page = (ROOT / "docs" / "models.md").read_text()
    example = page[page.index("### An example: the top class of logits"):]
    source = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    table = tomllib.loads(re.search(r"```toml\n(.*?)```", example, re.S).group(1))
    folder = workdir / "models" / "top1" / "v1"  # its repository, "models/top1", is read from the config's folder
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(source)
    daemon = Daemon(workdir, local_config(workdir, table["models"]))
    try:
        daemon.start()
        assert len(steps_of(daemon, "top1")) == table["models"]["top1"]["processes"]
        logits = np.random.default_rng(3).standard_normal((5, 10)).astype(np.float32)
        expected = in_process(folder, table["models"]["top1"]["parameters"])({"logits": logits})
        with daemon.client(retry=RetryPolicy(max_attempts=1)) as client:
            label, score = client.infer("top1", logits)
            np.testing.assert_array_equal(label, expected["label"])
            np.testing.assert_allclose(score, expected["score"], rtol=1e-6)
            assert label.dtype == np.int64 and score.dtype == np.float32 and score.shape == (5, 1)
            logits[0, 3] = np.nan
            with pytest.raises(InvalidRequest, match="^top1 v1: InvalidInput: logits must be finite numbers$"):
                client.infer("top1", logits)
    finally:
        daemon.kill_all()


def test_processes_a_sighup_cannot_make_arenas_for_are_all_taken_back_and_a_later_sighup_adds_them(
        start_daemon, python_repo, workdir):
    daemon = start_daemon({"scale": scale(workdir, repository=str(python_repo / "scale"))})
    arenas = sorted(SHM_DIR.glob(f"{ARENA_PREFIX}{daemon.process.pid}-*-w*"))
    instance = arenas[0].name[len(ARENA_PREFIX):].rpartition("-w")[0]
    # The second of the two new processes' arenas cannot be made: its name is taken.
    first_new, blocked = (SHM_DIR / arena_name(instance, len(arenas) + n) for n in (0, 1))
    blocked.write_bytes(b"")
    try:
        config = copy.deepcopy(daemon.config)
        config["models"]["scale"]["processes"] = 3
        daemon.config_path.write_text(to_toml(config))
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: "models.scale.processes cannot be raised" in daemon.log(), what="the SIGHUP refused")
        assert "cannot create the shared-memory arenas" in daemon.log()
        assert not first_new.exists(), "the arena made before the failure was kept"
        assert len(steps_of(daemon, "scale")) == 1
        with daemon.client() as client:
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            np.testing.assert_array_equal(client.infer("scale", x)[0], x * 2)
    finally:
        blocked.unlink()
    handled = daemon.log().count("SIGHUP: applied")
    daemon.signal(signal.SIGHUP)  # the same file again, now that the name is free
    wait_for(lambda: daemon.log().count("SIGHUP: applied") > handled, what="the second SIGHUP applied")
    wait_for(lambda: [w["state"] for w in steps_of(daemon, "scale")] == ["ready"] * 3, what="two processes more")
    assert first_new.exists() and blocked.exists()


def add_scale_by_sighup(daemon: Daemon, workdir: Path, python_repo: Path) -> None:
    """Add the scale model to `daemon`'s config file, SIGHUP it, and check scale's process serves."""
    config = copy.deepcopy(daemon.config)
    config["models"]["scale"] = scale(workdir, repository=str(python_repo / "scale"))
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: [w["state"] for w in steps_of(daemon, "scale")] == ["ready"], what="scale's process")
    with daemon.client() as client:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        np.testing.assert_array_equal(client.infer("scale", x)[0], x * 2)


def test_a_python_model_a_sighup_adds_while_a_reload_loads_serves_and_the_reload_ends_as_it_would(
        workdir, reload_repo, python_repo):
    repo, gate = gated_reload_repo(reload_repo, workdir, "v1")
    daemon = Daemon(workdir, base_config(workdir, repo, {"mlp": RELOAD_MLP})).start()
    try:
        reload = subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "reload", "--version",
                                   "gated"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "loading mlp gated" in reload.stdout.readline()
        add_scale_by_sighup(daemon, workdir, python_repo)
        gate.open()
        out, err = reload.communicate(timeout=120)
        assert reload.returncode == 0, err
        status = daemon.status()
        assert status["models"]["mlp"]["live_version"] == "gated"
        assert status["models"]["scale"]["live_version"] == "v1"
    finally:
        daemon.kill_all()


def test_a_python_model_a_sighup_adds_during_a_canary_serves_and_the_trial_goes_on(workdir, reload_repo, python_repo):
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP})).start()
    try:
        assert daemon.call("reload", timeout=60, version="v2", canary=50)["mode"] == "canary"
        add_scale_by_sighup(daemon, workdir, python_repo)
        with RawPeer(daemon.endpoint) as peer:
            for i in range(60):
                peer.send(i, "mlp", [np.zeros((1, models.MLP_IN), np.float32)])
            replies = [peer.recv()[0] for _ in range(60)]
        assert {r["status"] for r in replies} == {"ok"} and {r["version"] for r in replies} == {"v1", "v2"}
        assert daemon.call("promote", model="mlp")["version"] == "v2"
        assert daemon.status()["models"]["mlp"]["live_version"] == "v2"
    finally:
        daemon.kill_all()
