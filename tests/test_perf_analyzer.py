"""Triton's perf_analyzer (2.51, the C++ binary, unmodified: tests/third_party.py) against the real
daemon over HTTP and gRPC, with and without system shared memory, at concurrency 1 and 64. It
checks what it is answered against validation data computed by the same model in-process, and
reports the server's own breakdown (queue, compute) from inferd's statistics. Throughput is not
judged here: bench/perf_analyzer.py compares it with inferd's own load generator."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import models
import numpy as np
import pytest
from conftest import MLP, Daemon, base_config, reference
from third_party import missing_library, perf_analyzer

from inferd.harness import free_port

VENV = Path(__file__).resolve().parent.parent / ".venv"
# In the serial pass: 64 of perf_analyzer's threads at once would take the cores from the timed tests
# of the parallel one (a 15 ms deadline test found every request timed out beside them).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def tool() -> Path:
    if not perf_analyzer(VENV).exists():
        pytest.skip("perf_analyzer is not installed: `make test` installs it (tests/third_party.py)")
    missing = missing_library(VENV)
    if missing:
        pytest.skip(f"perf_analyzer needs {missing} (Debian's libb64-0d; .ci/run installs it)")
    return perf_analyzer(VENV)


@pytest.fixture(scope="module")
def served(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    """A daemon serving mlp as a Triton user would point perf_analyzer at it: client shared memory
    server-wide, under any name (perf_analyzer names its regions after the tensors)."""
    workdir = tmp_path_factory.mktemp("pa")
    config = base_config(workdir, repo, {"mlp": MLP}, server={
        "http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
        "allow_client_shm": True, "client_shm_prefix": "", "client_shm_scope": "server"})
    daemon = Daemon(workdir, config)
    daemon.start()
    yield daemon
    daemon.kill_all()


@pytest.fixture(scope="module")
def validation(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """perf_analyzer's input data with the outputs the model gives in-process, and a copy whose
    expected outputs are wrong (to show that it checks them)."""
    x = np.random.default_rng(21).standard_normal((1, models.MLP_IN), dtype=np.float32)
    expected = reference(repo, "mlp", "v2")(x)
    folder = tmp_path_factory.mktemp("pa-data")
    paths = []
    for name, outputs in (("right", expected), ("wrong", expected + 1)):
        data = {"data": [{"INPUT__0": x.ravel().tolist()}],
                "validation_data": [{"OUTPUT__0": outputs.ravel().tolist()}]}
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    return paths[0], paths[1]


def run(tool: Path, daemon: Daemon, protocol: str, report: Path, *options: str) -> subprocess.CompletedProcess:
    address = daemon.config["server"][protocol]
    # Three windows are taken as they come (perf_analyzer waits for three that agree within
    # --stability-percentage): on a machine shared with the rest of the suite they may not agree.
    return subprocess.run([str(tool), "-m", "mlp", "-u", address, "-i", protocol, "--measurement-interval", "250",
                           "--stability-percentage", "1000", "--max-trials", "5", "-f", str(report), *options],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("shared_memory", ["none", "system"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_at_concurrency_1_and_64_with_the_servers_breakdown(tool, served, validation,
                                                                                 tmp_path, protocol, shared_memory):
    # At concurrency 1 each request is a batch of one, as in-process, so its outputs match to the bit;
    # in larger batches a float may round differently, and perf_analyzer compares bytes. It validates
    # only outputs that come in the response (test_oip_shm checks those written in regions).
    checked = ["--input-data", str(validation[0])] if shared_memory == "none" else []
    for concurrency, data in (("1", checked), ("64", [])):
        report = tmp_path / f"c{concurrency}.csv"
        done = run(tool, served, protocol, report, "--concurrency-range", concurrency,
                   "--shared-memory", shared_memory, *data)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        [row] = csv.DictReader(report.open())
        assert row["Concurrency"] == concurrency and float(row["Inferences/Second"]) > 0
        # The server's side of perf_analyzer's breakdown, from inferd's statistics.
        for column in ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output"):
            assert float(row[column]) > 0, (column, row)
    assert set(served.call("stats")["models"]["mlp"]["requests"]) == {"ok"}
    assert served.status()["state"] == "serving"


def test_perf_analyzer_checks_the_outputs_against_its_validation_data(tool, served, validation, tmp_path):
    done = run(tool, served, "http", tmp_path / "report.csv", "--concurrency-range", "1",
               "--input-data", str(validation[1]))
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "Output doesn't match expected output" in said, said[-2000:]
