"""Pipelines: models chained in the daemon under a name of their own, each step batched with its model's other
requests; checked before serving, with per-step errors, deadlines, backpressure, reload and stats."""

from __future__ import annotations

import contextlib
import copy
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MLP, ONE_AT_A_TIME, Daemon, base_config, pipeline_held, reference, step_of, wait_for
from gates import Gate
from models import MLP_IN, MLP_OUT
from python_models import GATE, JOIN_CONFIG, RELAY_CONFIG, SCALE_CONFIG, SCALE_FEATURES, gated, in_process
from wire import RawPeer

from inferd import protocol
from inferd.harness import free_port, to_toml

BIN = Path(sys.executable).parent
SUM = {"inputs": [{"dtype": "float32", "shape": [SCALE_FEATURES]}], "max_batch_size": 16,
       "outputs": [{"name": "sum", "dtype": "float32", "shape": [1]}]}
# scale (x2) -> scale again (x2, named "again") -> sum: the middle step raises where its input passes 1000 (scale's
# range), so an input between 500 and 1000 fails there alone.
CHAIN = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [SCALE_FEATURES]}],
    "outputs": ["sum", "total"],
    "steps": [
        {"model": "scale", "inputs": {"x": "x"}, "outputs": {"scaled": "once", "total": "total"}},
        {"model": "scale", "name": "again", "inputs": {"x": "once"}, "outputs": {"scaled": "twice"}},
        {"model": "sum", "inputs": {"INPUT__0": "twice"}, "outputs": {"sum": "sum"}},
    ],
}


# The chain again with its middle step on a model of its own (the same model.py), whose one process a test can
# hold at gates (tests/gates.py) while the other steps run.
GAPPED = {**CHAIN, "steps": [CHAIN["steps"][0], {**CHAIN["steps"][1], "model": "scale2"}, CHAIN["steps"][2]]}


# `gapped` again, with one request of it under way at a time.
NARROW = {**GAPPED, "max_in_flight": 1}
# A graph: two steps take x side by side (scale's scaled and scale2's total), and join adds what they made.
FORK = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [SCALE_FEATURES]}],
    "outputs": ["y"],
    "steps": [
        {"model": "scale", "name": "left", "inputs": {"x": "x"}, "outputs": {"scaled": "a"}},
        {"model": "scale2", "name": "right", "inputs": {"x": "x"}, "outputs": {"total": "b"}},
        {"model": "join", "inputs": {"a": "a", "b": "b"}, "outputs": {"y": "y"}},
    ],
}
# x of any length up to 8 where its one step's model takes 4: a request of another length passes the
# pipeline's own check, and its first step refuses it.
LOOSE = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1], "max_shape": [2 * SCALE_FEATURES]}],
    "outputs": ["a"],
    "steps": [{"model": "scale", "inputs": {"x": "x"}, "outputs": {"scaled": "a"}}],
}
# variable (its input back, of a shape its config leaves to the model) then scale, which takes 4 values a sample:
# the pipeline passes its checks, and every request's second step refuses what the first made.
MISMATCHED = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
    "outputs": ["out"],
    "steps": [{"model": "variable", "inputs": {"INPUT__0": "x"}, "outputs": {"OUTPUT__0": "y"}},
              {"model": "scale", "inputs": {"x": "y"}, "outputs": {"scaled": "out"}}],
}
# A CPU step (relay, a Python model) then a tensor step (variable, TorchScript), each of which a test can hold.
RELAYED = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
    "outputs": ["out"],
    "steps": [{"model": "relay", "inputs": {"x": "x"}, "outputs": {"y": "y"}},
              {"model": "variable", "inputs": {"INPUT__0": "y"}, "outputs": {"OUTPUT__0": "out"}}],
}


def served_config(folder: Path, python_repo: Path, repo: Path) -> dict[str, Any]:
    """scale (Python, factor 2), scale2 (the same), relay, join (Python), sum and variable (TorchScript), the
    gates of the Python ones in folder/gates; with the pipelines `chain`, `gapped`, `narrow`, `fork`, `loose`,
    `relayed` and `mismatched` over them."""
    gates = folder / "gates"
    gates.mkdir(exist_ok=True)
    config = base_config(folder, python_repo, {
        "scale": {**SCALE_CONFIG, "version": "v1", "parameters": {"factor": 2.0, "gates": str(gates)}},
        "scale2": {**SCALE_CONFIG, "version": "v1", "parameters": {"factor": 2.0, "gates": str(gates)}},
        "relay": {**RELAY_CONFIG, "parameters": {"gates": str(gates)}},
        "join": JOIN_CONFIG})
    config["models"]["scale2"]["repository"] = str(python_repo / "scale")
    config["models"]["sum"] = {**SUM, "repository": str(repo / "sum")}
    config["models"]["variable"] = {**ONE_AT_A_TIME, "repository": str(repo / "variable")}
    # A copy: a test that changes a pipeline of its config changes no other config's.
    config["pipelines"] = copy.deepcopy({"chain": CHAIN, "gapped": GAPPED, "narrow": NARROW, "fork": FORK,
                                         "loose": LOOSE, "relayed": RELAYED, "mismatched": MISMATCHED})
    config["server"].update(metrics=f"127.0.0.1:{free_port()}", http=f"127.0.0.1:{free_port()}",
                            grpc=f"127.0.0.1:{free_port()}")
    return config


@contextlib.contextmanager
def daemon_of_its_own(python_repo: Path, repo: Path, queue_size: int | None = None,
                      pipelines: dict[str, Any] | None = None) -> Iterator[Daemon]:
    """A daemon of served_config, started in a folder of its own (with `queue_size` and `pipelines` in place of
    the config's, where given); killed, its folder removed, at the end."""
    folder = Path(tempfile.mkdtemp(prefix="inferd-p"))
    config = served_config(folder, python_repo, repo)
    if queue_size is not None:
        config["queue"]["max_size"] = queue_size
    if pipelines is not None:
        config["pipelines"] = pipelines
    daemon = Daemon(folder, config)
    try:
        yield daemon.start()
    finally:
        daemon.kill_all()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def served(python_repo: Path, repo: Path) -> Iterator[Daemon]:
    with daemon_of_its_own(python_repo, repo) as daemon:
        yield daemon


def chained(python_repo: Path, repo: Path) -> Any:
    """The chain's steps run in this process, one after the other: x -> (sum, total)."""
    scale = in_process(python_repo / "scale" / "v1", {"factor": 2.0})
    total = reference(repo, "sum", "v1")

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        once = scale({"x": x})
        twice = scale({"x": once["scaled"]})
        return total(twice["scaled"]), once["total"]

    return run


def test_a_pipeline_answers_as_its_steps_do_in_process(served, python_repo, repo):
    expected = chained(python_repo, repo)
    rng = np.random.default_rng(3)
    with RawPeer(served.endpoint) as peer:
        sent = {}
        for index in range(24):
            x = rng.uniform(0, 10, (1 + index % 3, SCALE_FEATURES)).astype(np.float32)
            sent[index] = x
            peer.send(index, "chain", [x])
        for _ in sent:
            header, outputs = peer.recv()
            assert header["status"] == "ok", header
            assert header["model"] == "chain" and header["version"] == "scale:v1,again:v1,sum:v1"
            want_sum, want_total = expected(sent[header["id"]])
            np.testing.assert_allclose(outputs[0], want_sum, rtol=1e-6)
            np.testing.assert_array_equal(outputs[1], want_total)


def broken(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with a pipeline beside `chain` for each way a pipeline cannot be served."""
    config = copy.deepcopy(config)
    pipes = config["pipelines"]

    def variant(name: str, change: Any) -> None:
        pipes[name] = copy.deepcopy(CHAIN)
        change(pipes[name])

    variant("unproduced", lambda p: p["steps"][2]["inputs"].update(INPUT__0="thrice"))
    variant("twice", lambda p: p["steps"][1]["outputs"].update(total="total"))
    variant("dtype", lambda p: p["steps"][2]["inputs"].update(INPUT__0="total"))
    variant("shape", lambda p: p["inputs"][0].update(shape=[5]))
    variant("cycle", lambda p: p["steps"][0]["inputs"].update(x="twice"))
    variant("nomodel", lambda p: p["steps"][1].update(model="scaler"))
    variant("noinput", lambda p: p["steps"][1]["inputs"].update(y="once"))
    variant("samename", lambda p: p["steps"][1].pop("name"))
    pipes["sum"] = copy.deepcopy(CHAIN)
    return config


REFUSALS = (
    "pipelines.unproduced.steps[2]: step sum takes tensor 'thrice' as input 'INPUT__0' of model sum, which neither "
    "the pipeline's inputs nor any step produces",
    "pipelines.twice.steps[1]: tensor 'total' is produced twice, by step scale (output 'total' of model scale) and "
    "by step again (output 'total' of model scale); give each a name of its own",
    "pipelines.dtype.steps[2]: step sum takes tensor 'total' as input 'INPUT__0' of model sum, which is float32, but "
    "step scale (output 'total' of model scale) makes it float64",
    "pipelines.shape.steps[0]: step scale takes tensor 'x' as input 'x' of model scale, which takes samples of "
    "shape [4], but the pipeline's input makes them [5]",
    "pipelines.cycle.steps: steps scale, again, sum each wait for another's output (a cycle: step scale takes tensor "
    "'twice' from step again (output 'scaled' of model scale)), so none can run",
    "pipelines.nomodel.steps[1]: step again names model 'scaler', which this daemon does not serve; it serves join, "
    "relay, scale, scale2, sum, variable",
    "pipelines.noinput.steps[1]: step again maps input 'y', which model scale does not have; it takes x",
    "pipelines.samename.steps[1]: step name 'scale' is also step 0's; give each step of the same model a name of "
    'its own (name = "...")',
    "pipelines.sum: 'sum' is also a model's name, and a pipeline is served under its own name; rename one of them",
)


def test_check_config_refuses_each_pipeline_that_cannot_be_served_in_one_sentence(python_repo, repo, tmp_path):
    good = served_config(tmp_path, python_repo, repo)
    path = tmp_path / "inferd.toml"
    path.write_text(to_toml(good))
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    counts = f"ok ({len(good['models'])} model(s), {len(good['pipelines'])} pipeline(s))"
    assert result.returncode == 0 and counts in result.stdout, result.stderr
    path.write_text(to_toml(broken(good)))
    result = subprocess.run([str(BIN / "inferd"), "check-config", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    said = [line.removeprefix(f"{path}: ") for line in result.stderr.strip().splitlines()]
    assert sorted(said[:-1]) == sorted(REFUSALS), said
    assert said[-1] == f"inferd: {path} has {len(REFUSALS)} problem(s)"


def test_the_daemon_refuses_to_start_or_to_take_a_sighup_with_a_pipeline_it_cannot_serve(served, python_repo,
                                                                                         repo, tmp_path):
    import signal

    bad = served_config(tmp_path, python_repo, repo)
    bad["pipelines"]["chain"]["steps"][2]["inputs"]["INPUT__0"] = "total"
    path = tmp_path / "bad.toml"
    path.write_text(to_toml(bad))
    result = subprocess.run([str(BIN / "inferd"), "serve", "--config", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert REFUSALS[2].replace("dtype", "chain") in result.stderr
    running = served.config_path.read_text()
    bad = copy.deepcopy(served.config)
    bad["pipelines"]["chain"]["steps"][2]["inputs"]["INPUT__0"] = "total"
    try:
        served.config_path.write_text(to_toml(bad))
        served.signal(signal.SIGHUP)
        wait_for(lambda: REFUSALS[2].replace("dtype", "chain") in served.log(), what="the SIGHUP refused")
    finally:
        served.config_path.write_text(running)
    with RawPeer(served.endpoint) as peer:  # the pipeline serves on as it was
        peer.send(1, "chain", [np.ones((1, SCALE_FEATURES), np.float32)])
        header, outputs = peer.recv()
        assert header["status"] == "ok" and outputs[0][0, 0] == 16.0


# mlp (float32 [16] -> [4]) then sum ([4] -> [1]), TorchScript both: pipelines a SIGHUP may change.
SUMMED = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [MLP_IN]}],
    "outputs": ["total"],
    "steps": [{"model": "mlp", "inputs": {"INPUT__0": "x"}, "outputs": {"OUTPUT__0": "h"}},
              {"model": "sum", "inputs": {"INPUT__0": "h"}, "outputs": {"OUTPUT__0": "total"}}],
}


def test_a_sighup_keeps_the_pipelines_serving_and_applies_what_changed_in_them(workdir, repo, python_repo):
    """Pipelines added, removed and changed, beside a Python model added, which starts its process then, and a
    pipeline over it."""
    import signal

    config = base_config(workdir, repo, {"mlp": {**MLP, "version": "v1"},
                                         "sum": {**MLP, "inputs": [{"dtype": "float32", "shape": [MLP_OUT]}]}})
    config["pipelines"] = {"summed": SUMMED, "mapped": {**SUMMED, "outputs": ["h"], "steps": SUMMED["steps"][:1]}}
    daemon = Daemon(workdir, config)
    try:
        daemon.start()
        changed = copy.deepcopy(config)
        changed["queue"]["max_size"] = 512
        changed["pipelines"]["summed"]["max_in_flight"] = 7
        del changed["pipelines"]["mapped"]
        changed["pipelines"]["added"] = {**SUMMED, "outputs": ["total", "h"]}
        changed["models"]["scale"] = {**SCALE_CONFIG, "repository": str(python_repo / "scale"), "version": "v1",
                                      "parameters": {"factor": 3.0}}
        changed["pipelines"]["scaled"] = {"inputs": [{"name": "x", "dtype": "float32", "shape": [SCALE_FEATURES]}],
                                          "outputs": ["y"], "steps": [{"model": "scale", "inputs": {"x": "x"},
                                                                       "outputs": {"scaled": "y"}}]}
        daemon.config_path.write_text(to_toml(changed))
        daemon.signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: applied" in daemon.log(), what="the SIGHUP carried out")
        log = daemon.log()
        assert "queue.max_size 1024 -> 512" in log and "pipelines.summed.max_in_flight 256 -> 7" in log
        assert "pipelines.mapped removed" in log and "pipelines.added added" in log
        assert "models.scale added" in log and "pipelines.scaled added" in log and "need a restart" not in log
        wait_for(lambda: step_of(daemon, "scale")["state"] == "ready", what="the Python model's process ready")
        x = np.random.default_rng(5).standard_normal((3, MLP_IN)).astype(np.float32)
        with RawPeer(daemon.endpoint) as peer:
            for name in ("summed", "added", "mapped", "scaled"):
                peer.send(name, name, [x if name != "scaled" else np.abs(x[:, :SCALE_FEATURES])])
            replies = replies_by_id(peer, 4)
        hidden = reference(repo, "mlp", "v1")(x)
        total = reference(repo, "sum", "v1")(hidden)
        header, outputs = replies["summed"]
        assert header["status"] == "ok", header
        np.testing.assert_allclose(outputs[0], total, rtol=1e-5)
        header, outputs = replies["added"]
        assert header["status"] == "ok" and header["version"] == "mlp:v1,sum:v1", header
        np.testing.assert_allclose(outputs[0], total, rtol=1e-5)
        np.testing.assert_allclose(outputs[1], hidden, rtol=1e-5)
        header, _ = replies["mapped"]
        assert header["status"] == "invalid" and header["error"].startswith("unknown model 'mapped'"), header
        header, outputs = replies["scaled"]
        assert header["status"] == "ok" and header["version"] == "scale:v1", header
        np.testing.assert_array_equal(outputs[0], np.abs(x[:, :SCALE_FEATURES]) * 3)
        pipelines = daemon.call("stats")["pipelines"]
        assert sorted(pipelines) == ["added", "scaled", "summed"] and pipelines["summed"]["max_in_flight"] == 7
    finally:
        daemon.kill_all()


def replies_by_id(peer: RawPeer, count: int) -> dict[Any, tuple[dict[str, Any], list[np.ndarray]]]:
    replies = {}
    while len(replies) < count:
        header, outputs = peer.recv(timeout=30)
        assert header["id"] not in replies, f"request {header['id']} answered twice"
        replies[header["id"]] = (header, outputs)
    return replies


def test_a_failing_middle_step_fails_its_request_alone_naming_the_step(served, python_repo, repo):
    expected = chained(python_repo, repo)
    rng = np.random.default_rng(4)
    sent = {index: rng.uniform(0, 10, (2, SCALE_FEATURES)).astype(np.float32) for index in range(16)}
    sent[5] = np.full((1, SCALE_FEATURES), 600, np.float32)  # 1200 at the middle step: over its range
    sums_before = served.call("stats")["pipelines"]["chain"]["steps"]["sum"]["compute_ms"]["count"]
    with RawPeer(served.endpoint) as peer:
        for index, x in sent.items():
            peer.send(index, "chain", [x])
        replies = replies_by_id(peer, len(sent))
    header, outputs = replies.pop(5)
    assert header["status"] == "internal" and not outputs
    assert header["error"].startswith("pipeline chain, step again (model scale v1): "), header
    assert "over 1000" in header["error"] and header["version"] == "scale:v1", header
    for index, (header, outputs) in replies.items():
        assert header["status"] == "ok", header
        want_sum, want_total = expected(sent[index])
        np.testing.assert_allclose(outputs[0], want_sum, rtol=1e-6)
        np.testing.assert_array_equal(outputs[1], want_total)
    steps = served.call("stats")["pipelines"]["chain"]["steps"]
    assert steps["sum"]["compute_ms"]["count"] == sums_before + len(replies), "the failed request's last step ran"


@contextlib.contextmanager
def held(daemon: Daemon, model: str) -> Iterator[None]:
    """Keep Python model `model`'s one process busy until the block ends: two batches of it wait at gates
    (tests/gates.py), one running and one behind it, so that its requests sent meanwhile wait in the queue."""
    gates = daemon.workdir / "gates"
    with RawPeer(daemon.endpoint) as peer:
        def hold(gate: Gate, full: bool) -> None:
            peer.send(f"gate{gate.number}", model, [gated(gate.number, rows=8 if full else 1)], timeout_ms=60_000)

        with pipeline_held(daemon, lambda: Gate(gates), hold, lambda: step_of(daemon, model)):
            yield
        assert len({peer.recv(timeout=30)[0]["id"] for _ in range(2)}) == 2, "both held batches answered"


def step_counts(daemon: Daemon, pipeline: str) -> dict[str, int]:
    """How many requests each step of `pipeline` has computed."""
    return {step: part["compute_ms"]["count"] for step, part in daemon.call("stats")["pipelines"][pipeline]["steps"]
            .items()}


ONES = np.ones((1, SCALE_FEATURES), np.float32)


def test_a_deadline_that_passes_between_steps_answers_timeout_naming_the_step(served):
    with RawPeer(served.endpoint) as peer:
        with held(served, "scale2"):
            peer.send("late", "gapped", [ONES], timeout_ms=300)
            header, outputs = peer.recv(timeout=30)
        assert header["id"] == "late" and header["status"] == "timeout" and not outputs
        assert header["error"] == ("pipeline gapped, step again (model scale2 v1): the deadline passed before the "
                                   "request ran")
        assert header["version"] == "scale:v1"  # its first step ran, its last did not


def test_a_cancelled_pipeline_request_is_answered_at_once_and_its_later_steps_never_run(served):
    before = step_counts(served, "gapped")
    with RawPeer(served.endpoint) as peer:
        with held(served, "scale2"):
            peer.send("doomed", "gapped", [ONES], timeout_ms=60_000)
            wait_for(lambda: step_counts(served, "gapped")["scale"] == before["scale"] + 1, what="its first step")
            assert served.status()["models"]["scale2"]["queue_depth"] == 1, "its second step waits in the queue"
            peer.send_frames([protocol.encode_op(protocol.Cancel(id="doomed"))])
            header, outputs = peer.recv(timeout=30)
            assert header["id"] == "doomed" and header["status"] == "cancelled" and not outputs
            assert header["error"] == ("pipeline gapped, step again (model scale2): cancelled by its client; its "
                                       "later steps do not run")
            assert header["version"] == "scale:v1"
            assert served.status()["models"]["scale2"]["queue_depth"] == 0, "its second step left the queue"
        peer.send("after", "gapped", [ONES])  # behind anything of the cancelled one that could still run
        header, _ = peer.recv(timeout=30)
        assert header["id"] == "after" and header["status"] == "ok"
    after = step_counts(served, "gapped")
    assert after == {"scale": before["scale"] + 2, "again": before["again"] + 1, "sum": before["sum"] + 1}, \
        "the cancelled request's second and third steps never ran"


def test_cancelling_a_pipeline_request_leaves_a_direct_request_of_the_same_id_in_the_queue(served):
    # One connection, one id, two requests: the pipeline's first step waits in the queue beside the direct one.
    with RawPeer(served.endpoint) as peer:
        with held(served, "scale"):
            peer.send(5, "scale", [ONES], timeout_ms=60_000)
            peer.send(5, "chain", [ONES], timeout_ms=60_000)
            wait_for(lambda: served.status()["models"]["scale"]["queue_depth"] == 2, what="both in the queue")
            peer.send_frames([protocol.encode_op(protocol.Cancel(id=5))])
            header, _ = peer.recv(timeout=30)
            assert (header["model"], header["status"]) == ("chain", "cancelled"), header
            assert served.status()["models"]["scale"]["queue_depth"] == 1, "the direct request waits on"
        header, outputs = peer.recv(timeout=30)
        assert (header["id"], header["model"], header["status"]) == (5, "scale", "ok"), header
        np.testing.assert_allclose(outputs[0], ONES * 2)


def test_a_pipeline_requests_priority_carries_to_each_of_its_steps(served):
    def urgent_ok(model: str) -> int:
        levels = served.call("stats")["models"][model]["priorities"]
        return levels.get("0", {}).get("requests", {}).get("ok", 0)

    before = {model: urgent_ok(model) for model in ("scale", "sum")}
    with RawPeer(served.endpoint) as peer:
        for index in range(3):
            peer.send(index, "chain", [ONES], priority=0)
        assert all(header["status"] == "ok" for header, _ in replies_by_id(peer, 3).values())
    assert urgent_ok("scale") == before["scale"] + 6, "its steps scale and again, each at priority 0"
    assert urgent_ok("sum") == before["sum"] + 3


def test_a_pipeline_past_its_max_in_flight_is_answered_overloaded_and_admits_again_once_one_is_done(served):
    with RawPeer(served.endpoint) as peer:
        with held(served, "scale2"):
            peer.send("first", "narrow", [ONES], timeout_ms=60_000)
            wait_for(lambda: served.call("stats")["pipelines"]["narrow"]["in_flight"] == 1, what="first admitted")
            peer.send("second", "narrow", [ONES], timeout_ms=60_000)
            header, outputs = peer.recv(timeout=30)
            assert header["id"] == "second" and header["status"] == "overloaded" and not outputs
            assert header["error"] == ("pipeline narrow has 1 requests in flight (pipelines.narrow.max_in_flight); "
                                       "retry later")
        header, _ = peer.recv(timeout=30)
        assert header["id"] == "first" and header["status"] == "ok"
        peer.send("third", "narrow", [ONES])
        header, _ = peer.recv(timeout=30)
        assert header["id"] == "third" and header["status"] == "ok"


def test_a_graph_runs_the_steps_that_take_one_tensor_side_by_side_and_joins_them(served, python_repo):
    scale = in_process(python_repo / "scale" / "v1", {"factor": 2.0})
    x = np.random.default_rng(9).uniform(0, 10, (3, SCALE_FEATURES)).astype(np.float32)
    before = step_counts(served, "fork")
    with RawPeer(served.endpoint) as peer:
        with held(served, "scale"):  # the left branch waits; the right one runs meanwhile
            peer.send("forked", "fork", [x], timeout_ms=60_000)
            wait_for(lambda: step_counts(served, "fork")["right"] == before["right"] + 1, what="the right branch")
            assert step_counts(served, "fork") == {**before, "right": before["right"] + 1}
        header, outputs = peer.recv(timeout=30)
    assert header["status"] == "ok" and header["version"] == "left:v1,right:v1,join:v1", header
    want = scale({"x": x})
    np.testing.assert_allclose(outputs[0], want["scaled"] + want["total"], rtol=1e-6)


def test_a_cpu_step_and_a_tensor_step_run_at_once_for_two_requests(served, gates, repo):
    variable = reference(repo, "variable", "v1")
    in_tensor_step, in_cpu_step = gates(), Gate(served.workdir / "gates")
    relay = np.array([[GATE, in_cpu_step.number]], np.float32)
    before = step_counts(served, "relayed")
    with RawPeer(served.endpoint) as peer:
        try:
            peer.send("a", "relayed", [in_tensor_step.input], timeout_ms=60_000)
            wait_for(lambda: step_counts(served, "relayed")["relay"] == before["relay"] + 1, what="a's relay step")
            peer.send("b", "relayed", [relay], timeout_ms=60_000)
            wait_for(lambda: step_of(served, "relay")["batches_in_flight"] == 1, what="b in its relay step")
            # a's tensor step (held at its gate) and b's CPU step (held at its own) are both under way.
            [tensor] = [w for w in served.status()["workers"] if w["kind"] != "step"]
            assert tensor["executors_busy"] == 1 and tensor["requests_in_flight"] == 1
            assert step_counts(served, "relayed") == {"relay": before["relay"] + 1, "variable": before["variable"]}
        finally:
            in_cpu_step.open()
            in_tensor_step.open()
        answers = replies_by_id(peer, 2)
    assert answers["a"][0]["status"] == answers["b"][0]["status"] == "ok"
    np.testing.assert_allclose(answers["b"][1][0], variable(relay), rtol=1e-6)


def test_a_request_under_way_when_a_sighup_changes_its_pipeline_finishes_with_the_steps_it_began_with(served, repo):
    import signal

    variable = reference(repo, "variable", "v1")
    held = Gate(served.workdir / "gates")
    x = np.array([[GATE, held.number]], np.float32)
    running = served.config_path.read_text()
    relay_only = copy.deepcopy(served.config)
    relay_only["pipelines"]["relayed"] = {**RELAYED, "outputs": ["y"], "steps": RELAYED["steps"][:1]}

    def sighup(config_text: str) -> None:
        applied = served.log().count("SIGHUP: applied")
        served.config_path.write_text(config_text)
        served.signal(signal.SIGHUP)
        wait_for(lambda: served.log().count("SIGHUP: applied") > applied, what="the SIGHUP applied")

    with RawPeer(served.endpoint) as peer:
        try:
            peer.send("before", "relayed", [x], timeout_ms=60_000)
            wait_for(lambda: step_of(served, "relay")["batches_in_flight"] == 1, what="its relay step held")
            sighup(to_toml(relay_only))
            assert "pipelines.relayed.outputs changed; pipelines.relayed.steps changed" in served.log()
            held.open()
            before_header, before_outputs = peer.recv(timeout=30)
            peer.send("after", "relayed", [x + 1])
            after_header, after_outputs = peer.recv(timeout=30)
        finally:
            if held.path.exists():  # not opened above
                held.open()
            sighup(running)
    assert before_header["status"] == "ok" and before_header["version"] == "relay:v1,variable:v1", before_header
    np.testing.assert_allclose(before_outputs[0], variable(x), rtol=1e-6)
    assert after_header["status"] == "ok" and after_header["version"] == "relay:v1", after_header
    np.testing.assert_array_equal(after_outputs[0], x + 1)


def test_a_later_step_finding_the_queue_full_waits_for_room_until_its_deadline(python_repo, repo):
    """An admitted request is never answered overloaded: its second step waits for room in the full queue, and
    is queued once there is some, or answered timeout at its deadline."""
    pipelines = {"held_first": {
        "inputs": CHAIN["inputs"], "outputs": ["sum"],
        "steps": [{"model": "scale2", "name": "first", "inputs": {"x": "x"}, "outputs": {"scaled": "scaled"}},
                  {"model": "sum", "inputs": {"INPUT__0": "scaled"}, "outputs": {"sum": "sum"}}]}}
    with daemon_of_its_own(python_repo, repo, queue_size=4, pipelines=pipelines) as daemon:
        first, second = Gate(daemon.workdir / "gates"), Gate(daemon.workdir / "gates")
        with RawPeer(daemon.endpoint) as peer:
            # Both first steps held in scale2's process (the one behind the other), each request of its own.
            peer.send("waits", "held_first", [gated(first.number)], timeout_ms=60_000)
            wait_for(lambda: step_of(daemon, "scale2")["batches_in_flight"] == 1, what="waits in its first step")
            peer.send("expires", "held_first", [gated(second.number)], timeout_ms=8_000)
            wait_for(lambda: step_of(daemon, "scale2")["batches_in_flight"] == 2, what="expires behind it")
            with held(daemon, "scale"):
                for index in range(4):  # scale's process is busy: these fill the queue
                    peer.send(index, "scale", [ONES], timeout_ms=60_000)
                wait_for(lambda: daemon.status()["models"]["scale"]["queue_depth"] == 4, what="the queue full")
                peer.send("refused", "held_first", [ONES])
                header, _ = peer.recv(timeout=30)
                assert header["id"] == "refused" and header["status"] == "overloaded"
                assert header["error"] == "pipeline held_first, step first: the queue is full (4 requests); retry later"
                first.open()
                second.open()
                header, outputs = peer.recv(timeout=30)  # the queue stays full: its second step cannot be queued
                assert header["id"] == "expires" and header["status"] == "timeout" and not outputs
                assert header["error"].startswith(
                    "pipeline held_first, step sum (model sum): the deadline passed while the step waited for room "
                    "in the queue (queue.max_size 4, queue.max_bytes "), header
                assert header["version"] == "first:v1"
            replies = replies_by_id(peer, 5)  # room once scale ran: the one that waited is answered
        header, outputs = replies.pop("waits")
        assert header["status"] == "ok" and header["version"] == "first:v1,sum:v1"
        np.testing.assert_array_equal(outputs[0], np.zeros((1, 1), np.float32))
        assert all(header["status"] == "ok" for header, _ in replies.values())


def test_a_later_step_in_a_full_queue_is_not_displaced_by_a_more_urgent_request(python_repo, repo):
    """A more urgent request displaces less urgent ones from a full queue, but not an admitted pipeline request's
    later step: that would drop it for a full queue, with its first step computed."""
    pipelines = {"then_scale": {
        "inputs": CHAIN["inputs"], "outputs": ["twice"],
        "steps": [{"model": "scale2", "name": "first", "inputs": {"x": "x"}, "outputs": {"scaled": "once"}},
                  {"model": "scale", "inputs": {"x": "once"}, "outputs": {"scaled": "twice"}}]}}
    with daemon_of_its_own(python_repo, repo, queue_size=2, pipelines=pipelines) as daemon:
        def queued() -> int:
            return daemon.status()["models"]["scale"]["queue_depth"]

        with RawPeer(daemon.endpoint) as peer:
            with held(daemon, "scale"):
                peer.send("direct", "scale", [ONES], priority=1, timeout_ms=60_000)
                wait_for(lambda: queued() == 1, what="the direct request queued")
                peer.send("pipeline", "then_scale", [ONES], priority=1, timeout_ms=60_000)
                wait_for(lambda: queued() == 2, what="the pipeline's second step queued: the queue full")
                peer.send("urgent", "scale", [ONES], priority=0, timeout_ms=60_000)
                header, _ = peer.recv(timeout=30)
                assert header["id"] == "direct" and header["status"] == "overloaded", header
                assert header["error"].startswith("displaced by a more urgent request (priority 0)"), header
            replies = replies_by_id(peer, 2)
        header, outputs = replies["pipeline"]
        assert header["status"] == "ok" and header["version"] == "first:v1,scale:v1", header
        np.testing.assert_array_equal(outputs[0], ONES * 4)
        assert replies["urgent"][0]["status"] == "ok"


def test_an_urgent_pipeline_request_is_admitted_as_an_urgent_request_to_its_first_step_would_be(python_repo, repo):
    with daemon_of_its_own(python_repo, repo, queue_size=2) as daemon:
        with RawPeer(daemon.endpoint) as peer:
            with held(daemon, "scale"):
                for name in ("older", "newer"):
                    peer.send(name, "scale", [ONES], priority=1, timeout_ms=60_000)
                wait_for(lambda: daemon.status()["models"]["scale"]["queue_depth"] == 2, what="the queue full")
                peer.send("urgent", "chain", [ONES], priority=0, timeout_ms=60_000)
                header, _ = peer.recv(timeout=30)
                assert header["id"] == "newer" and header["status"] == "overloaded", header
                assert header["error"].startswith("displaced by a more urgent request (priority 0)"), header
            replies = replies_by_id(peer, 2)
        assert replies["older"][0]["status"] == "ok"
        header, outputs = replies["urgent"]
        assert header["status"] == "ok", header
        np.testing.assert_allclose(outputs[0], chained(python_repo, repo)(ONES)[0], rtol=1e-6)


def test_a_sigterm_drains_the_pipeline_requests_under_way_between_their_steps(python_repo, repo):
    import signal

    total = chained(python_repo, repo)
    x = np.arange(20 * SCALE_FEATURES, dtype=np.float32).reshape(20, 1, SCALE_FEATURES) / 100
    with daemon_of_its_own(python_repo, repo) as daemon:
        with RawPeer(daemon.endpoint) as peer:
            with held(daemon, "scale2"):  # gapped's middle step: each request waits there, its first step done
                for index in range(20):
                    peer.send(index, "gapped", [x[index]], timeout_ms=60_000)
                wait_for(lambda: daemon.status()["models"]["scale2"]["queue_depth"] == 20,
                         what="every request past its first step")
                daemon.signal(signal.SIGTERM)
                wait_for(lambda: "stopping: finishing" in daemon.log(), what="the drain begun")
            replies = replies_by_id(peer, 20)
        for index, (header, outputs) in replies.items():
            assert header["status"] == "ok", header
            np.testing.assert_allclose(outputs[0], total(x[index])[0], rtol=1e-6)
        assert daemon.wait() == 0


def test_an_http_client_that_closes_its_connection_cancels_its_pipeline_request_between_steps(served):
    import json
    import socket

    def gapped() -> dict[str, int]:
        return served.call("stats")["pipelines"]["gapped"]["requests"]

    host, port = served.config["server"]["http"].rsplit(":", 1)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_FEATURES],
                                   "data": [1.0] * SCALE_FEATURES}]}).encode()
    before = gapped()
    with held(served, "scale2"):  # its middle step: the request waits there, its first step done
        client = socket.create_connection((host, int(port)), timeout=10)
        client.sendall(b"POST /v2/models/gapped/infer HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: served.status()["models"]["scale2"]["queue_depth"] == 1, what="its middle step queued")
        client.close()
        wait_for(lambda: gapped().get("cancelled", 0) == before.get("cancelled", 0) + 1,
                 what="the request answered cancelled")
        assert served.status()["models"]["scale2"]["queue_depth"] == 0, "its middle step left the queue at once"
    assert served.call("stats")["pipelines"]["gapped"]["in_flight"] == 0


def test_a_pipeline_has_no_versions_of_its_own(served):
    from inferd.ipc.control import ControlError

    with RawPeer(served.endpoint) as peer:
        peer.send(1, "chain", [np.ones((1, SCALE_FEATURES), np.float32)], version="v1")
        header, _ = peer.recv()
    assert header["status"] == "invalid" and header["error"] == (
        "chain is a pipeline, which has no versions of its own (its reply's version names its steps'); leave version "
        "out")
    with pytest.raises(ControlError, match=r"^chain is a pipeline, which has no versions of its own: reload, load or "
                                           r"try versions of the models it runs \(scale, sum\)"):
        served.call("reload", model="chain", version="v2")


def test_a_request_its_first_step_cannot_take_is_refused_invalid_naming_the_step(served):
    # Its pipeline takes x of any length up to 8, its first step's model 4: the step refuses 3 (not `overloaded`,
    # which a client would retry).
    with RawPeer(served.endpoint) as peer:
        peer.send("short", "loose", [np.ones((1, SCALE_FEATURES - 1), np.float32)])
        peer.send("fits", "loose", [np.ones((1, SCALE_FEATURES), np.float32)])
        replies = replies_by_id(peer, 2)
    refused = replies["short"][0]
    assert refused["status"] == "invalid" and refused["error"].startswith("pipeline loose, step scale: "), refused
    assert replies["fits"][0]["status"] == "ok"
    assert served.call("stats")["pipelines"]["loose"]["in_flight"] == 0


def test_a_later_step_refusing_what_the_steps_before_it_made_is_the_pipelines_fault_not_the_clients(served):
    with RawPeer(served.endpoint) as peer:
        peer.send("made", "mismatched", [np.ones((1, 2), np.float32)])
        header = peer.recv()[0]
    assert header["status"] == "internal", header  # 500: the client's request was what the pipeline takes
    assert header["error"].startswith("pipeline mismatched, step scale (model scale): the tensors the steps before it "
                                      "made do not fit its model: "), header


def test_stats_and_metrics_show_each_pipeline_and_the_wait_and_compute_of_each_step(served):
    from test_observability import scrape

    with RawPeer(served.endpoint) as peer:
        for index in range(5):
            peer.send(index, "chain", [np.ones((1, SCALE_FEATURES), np.float32)])
        replies_by_id(peer, 5)
    stats = served.call("stats")["pipelines"]["chain"]
    assert list(stats["steps"]) == ["scale", "again", "sum"]
    assert stats["steps"]["again"]["model"] == "scale" and stats["in_flight"] == 0
    ok = stats["requests"]["ok"]
    assert ok >= 5 and stats["latency_ms"]["count"] == ok
    assert all(step["wait_ms"]["count"] == step["compute_ms"]["count"] >= ok for step in stats["steps"].values())
    scraped = scrape(served)
    assert scraped[("inferd_pipeline_requests_total", (("pipeline", "chain"), ("status", "ok")))] == ok
    assert scraped[("inferd_pipeline_latency_seconds_count", (("pipeline", "chain"),))] == ok
    for step, part in stats["steps"].items():
        for phase in ("wait", "compute"):
            labels = (("phase", phase), ("pipeline", "chain"), ("step", step))
            assert scraped[("inferd_pipeline_step_seconds_count", labels)] == part[f"{phase}_ms"]["count"]
    shown = subprocess.run([str(BIN / "inferctl"), "--control", served.control, "stats"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and f"pipeline chain: {sum(stats['requests'].values())} requests" in shown.stdout
    assert "  again         scale" in shown.stdout


def test_the_daemons_reply_count_counts_a_pipeline_request_once_and_its_steps_in_their_models(served):
    def scale_requests() -> dict[str, int]:
        return served.call("stats")["models"]["scale"]["requests"]

    replies_before, scale_before = served.status()["replies"], scale_requests()
    with RawPeer(served.endpoint) as peer:
        for index in range(4):
            peer.send(index, "chain", [ONES])
        peer.send("fails", "chain", [np.full((1, SCALE_FEATURES), 600, np.float32)])  # at its second step
        answers = replies_by_id(peer, 5)
    assert answers["fails"][0]["status"] == "internal"
    replies = served.status()["replies"]
    assert replies.get("ok", 0) == replies_before.get("ok", 0) + 4, "each request answered ok counted once"
    assert replies.get("internal", 0) == replies_before.get("internal", 0) + 1, "the failed one counted once"
    scale = scale_requests()
    assert scale.get("ok", 0) == scale_before.get("ok", 0) + 9, "steps scale and again of 4, and scale of the 5th"
    assert scale.get("internal", 0) == scale_before.get("internal", 0) + 1, "its step again, which failed"


def test_a_pipeline_is_served_over_http_and_grpc_as_a_model_is(served, python_repo, repo):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    expected = chained(python_repo, repo)
    x = np.random.default_rng(6).uniform(0, 10, (3, SCALE_FEATURES)).astype(np.float32)
    want_sum, want_total = expected(x)
    versions = "scale:v1,again:v1,sum:v1"
    for module, address in ((httpclient, served.config["server"]["http"]),
                            (grpcclient, served.config["server"]["grpc"])):
        client = module.InferenceServerClient(address)
        try:
            assert client.is_model_ready("chain")
            metadata = client.get_model_metadata("chain")
            metadata = metadata if isinstance(metadata, dict) else {
                "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.inputs],
                "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.outputs],
                "versions": list(metadata.versions), "platform": metadata.platform}
            assert metadata["platform"] == "ensemble", "as Triton names what chains models"
            assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, SCALE_FEATURES]}]
            assert metadata["outputs"] == [{"name": "sum", "datatype": "FP32", "shape": [-1, 1]},
                                           {"name": "total", "datatype": "FP64", "shape": [-1, 1]}]
            assert metadata["versions"] == [versions]
            counted = statistics(client, "chain")
            given = module.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            result = client.infer("chain", [given])
            np.testing.assert_allclose(result.as_numpy("sum"), want_sum, rtol=1e-6)
            np.testing.assert_array_equal(result.as_numpy("total"), want_total)
            response = result.get_response()
            if isinstance(response, dict):
                assert response["model_version"] == versions
                assert response["parameters"] == {"step_versions": versions}
            else:
                assert response.model_version == versions
                assert response.parameters["step_versions"].string_param == versions
            bad = module.InferInput("x", [1, SCALE_FEATURES], "FP32")
            bad.set_data_from_numpy(np.full((1, SCALE_FEATURES), 600, np.float32))
            with pytest.raises(Exception, match=r"pipeline chain, step again \(model scale v1\)") as raised:
                client.infer("chain", [bad])
            status = raised.value.status()
            assert status in ("500", "StatusCode.INTERNAL"), status
            # As Triton's statistics count an ensemble's: its requests and samples, not its steps' batches.
            assert statistics(client, "chain") == (versions, counted[1] + 3, counted[2] + 1, counted[3] + 1)
        finally:
            client.close()


def statistics(client: Any, model: str) -> tuple[str, int, int, int]:
    """The statistics extension's version, inference count, successes and failures of `model`, as either of
    Triton's clients reads them (gRPC's, asked for as JSON, leaves zeros out)."""
    grpc = "grpc" in type(client).__module__
    (stats,) = client.get_inference_statistics(model, **({"as_json": True} if grpc else {}))["model_stats"]
    counts = stats["inference_stats"]
    return (stats["version"], int(stats.get("inference_count", 0)), int(counts["success"].get("count", 0)),
            int(counts["fail"].get("count", 0)))


def under_load(daemon: Daemon, pipeline: str, count: int, during: Any) -> tuple[list[np.ndarray], list[Any]]:
    """Requests of `pipeline`, 32 in flight, with `during()` called once `count` // 5 are answered: at least
    `count` of them, and 64 more once the function `during()` returned says it is done. The inputs and every
    answer (the client's futures' results, or what they raised), in order."""
    rng = np.random.default_rng(12)
    inputs: list[np.ndarray] = []
    answers: list[Any] = []
    done: Any = None

    def result(future: Any) -> Any:
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - the test asserts there are none
            return exc

    with daemon.client() as client:
        window: list[Any] = []
        after = None  # once `during` is done: how many requests are sent in all (64 more, to see its effect)
        while after is None or len(inputs) < after:
            if after is None and done is not None and done():
                after = max(count, len(inputs) + 64)
            inputs.append(rng.uniform(0, 10, (int(rng.integers(1, 4)), SCALE_FEATURES)).astype(np.float32))
            window.append(client.submit(pipeline, inputs[-1]))
            if len(window) == 32:
                answers.append(result(window.pop(0)))
            if len(answers) == count // 5 and done is None:
                done = during()
        answers += [result(future) for future in window]
    return inputs, answers


def test_a_python_step_killed_under_pipeline_load_loses_nothing(served, python_repo, repo):
    import os
    import signal

    from conftest import exited

    expected = chained(python_repo, repo)
    [step] = [w for w in served.status()["workers"] if w.get("model") == "scale2"]
    def kill() -> Any:
        os.kill(step["pid"], signal.SIGKILL)
        return lambda: any(w.get("model") == "scale2" and w["state"] == "ready" and w["pid"] != step["pid"]
                           for w in served.status()["workers"])

    inputs, answers = under_load(served, "gapped", 600, kill)
    errors = [answer for answer in answers if isinstance(answer, Exception)]
    assert not errors, errors[:3]
    for x, (got_sum, got_total) in zip(inputs, answers):
        want_sum, want_total = expected(x)
        np.testing.assert_allclose(got_sum, want_sum, rtol=1e-6)
        np.testing.assert_array_equal(got_total, want_total)
    wait_for(lambda: exited(step["pid"]), what="the killed step gone")
    assert "step scale2.0 (ready) died: killed by signal 9" in served.log()


def test_a_middle_step_reloaded_under_pipeline_load_drops_nothing(served, python_repo, repo):
    import threading

    scale = {version: in_process(python_repo / "scale" / version, {"factor": 2.0}) for version in ("v1", "v2")}
    total = reference(repo, "sum", "v1")
    reloaded: list[Any] = []

    def reload() -> Any:
        thread = threading.Thread(target=lambda: reloaded.append(served.call("reload", timeout=60, model="scale2",
                                                                               version="v2")))
        thread.start()
        return lambda: not thread.is_alive()

    try:
        inputs, answers = under_load(served, "gapped", 600, reload)
    finally:
        served.call("reload", timeout=60, model="scale2", version="v1")
    assert reloaded, "the reload answered"
    errors = [answer for answer in answers if isinstance(answer, Exception)]
    assert not errors, errors[:3]
    matched = {"v1": 0, "v2": 0}
    for x, (got_sum, got_total) in zip(inputs, answers):
        once = scale["v1"]({"x": x})
        np.testing.assert_array_equal(got_total, once["total"])
        for version in matched:  # each answer is one version's or the other's, never a mixture
            if np.allclose(got_sum, total(scale[version]({"x": once["scaled"]})["scaled"]), rtol=1e-6):
                matched[version] += 1
                break
        else:
            raise AssertionError(f"an answer of neither version: {got_sum}")
    assert matched["v1"] and matched["v2"] and sum(matched.values()) == len(inputs), matched
