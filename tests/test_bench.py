"""The benchmark's own tools still work: the load generators against the bare echo, and the daemon;
the shared-memory echo benchmark, and bench.compare's path through inferd, briefly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import models
import pytest
import torch

from bench import compare, loadgen, oip_loadgen, shm_echo
from bench import models as bench_models
from inferd.harness import free_port

# Benchmarks' smoke tests count what a machine manages in a fraction of a second: run them on a quiet one.
pytestmark = pytest.mark.serial


def test_the_load_generator_drives_the_bare_echo_and_counts_every_reply():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    echo = subprocess.Popen([sys.executable, "-m", "bench.echo", endpoint])
    try:
        # Requests sent while the echo starts wait in ZeroMQ; the warm-up covers its start.
        result = loadgen.run(endpoint, "m", (256,), "float32", concurrency=8, seconds=0.5, warmup=1.5)
    finally:
        echo.kill()
        echo.wait()
    assert result["statuses"].keys() == {"ok"} and result["requests"] > 8
    assert result["samples_per_s"] == result["requests"] / 0.5
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"] <= result["latency_ms"]["max"]
    assert result["cpu_us_per_request"] > 0


def test_the_load_generator_against_the_daemon_gets_answers_of_the_right_model(shared_daemon):
    result = loadgen.run(shared_daemon.endpoint, "mlp", (models.MLP_IN,), "float32", concurrency=4, seconds=0.5,
                         warmup=0.1)
    assert result["statuses"].keys() == {"ok"} and result["requests"] > 4
    wrong = loadgen.run(shared_daemon.endpoint, "mlp", (models.MLP_IN + 1,), "float32", concurrency=2, seconds=0.2,
                        warmup=0.0)
    assert wrong["statuses"].keys() == {"invalid"} and wrong["latency_ms"]["p50"] != wrong["latency_ms"]["p50"]


@pytest.mark.parametrize("protocol_name", ["http", "grpc"])
def test_the_oip_load_generator_gets_answers_and_counts_refusals(oip_daemon, protocol_name):
    address = oip_daemon.config["server"][protocol_name]
    result = asyncio.run(oip_loadgen.run(protocol_name, address, "mlp", (models.MLP_IN,), concurrency=4, seconds=0.5,
                                         warmup=0.2))
    assert result["statuses"] == {"ok": result["requests"]} and result["requests"] > 0
    assert result["latency_ms"]["p50"] > 0
    wrong = asyncio.run(oip_loadgen.run(protocol_name, address, "mlp", (models.MLP_IN + 1,), concurrency=2,
                                        seconds=0.2, warmup=0.0))
    assert set(wrong["statuses"]) == {"400" if protocol_name == "http" else "INVALID_ARGUMENT"}


def test_the_shared_memory_echo_benchmark_measures_every_case_at_both_sizes(capsys):
    # Half a second per case, in the serial pass (in 0.3 s beside another test file a busy machine once
    # answered no large request).
    assert shm_echo.main(["--seconds", "0.5", "--warmup", "0.1"]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["size_bytes"], r["case"]) for r in rows] == [
        (size, case) for size in shm_echo.SIZES.values() for case in shm_echo.CASES]
    assert all(r["bench"] == "shm_echo" and r["bytes_per_s"] > 0 for r in rows)
    assert all(r["requests"] > 0 for r in rows if r["case"] != "copy_bound")
    assert [r["ratio_to_bare"] for r in rows if r["case"] == "bare_echo"] == [1.0, 1.0]
    assert out.count("target: ") == len(shm_echo.TARGETS)


def test_the_comparison_checks_inferds_answer_over_http_and_drives_it_with_the_shared_loop(tmp_path):
    # The path every server of bench.compare takes: its request made once, its first answer checked against
    # the model in this process, then bench.oip_loadgen sending those bytes (--request) in a closed loop.
    torch.manual_seed(0)
    model = bench_models.save(bench_models.mlp(), tmp_path / "repo", "mlp", "v1")
    rows = compare.measure("inferd", tmp_path, model, levels=(2,), seconds=0.5, round_=0)
    assert [(r["server"], r["concurrency"]) for r in rows] == [("inferd", 2)]
    assert rows[0]["statuses"].keys() == {"ok"} and rows[0]["samples_per_s"] > 0
