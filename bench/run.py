"""The benchmark matrix: inferd against its references, measured in one run.

    python -m bench.run [--seconds 5] [--quick]

References, with the worker's torch thread count (1): the model called
in-process (batch-1 latency; samples/s per batch size), measured again right
before each configuration's cases, and a bare pyzmq ROUTER echo of the same
payload driven by the same load generator. inferd
runs with streams 1 and 2 and one and two CPU workers; each configuration
serves mlp and cnn at concurrency 1 and 64, and echo at 1 MB and 16 MB at
concurrency 4; and mlp and cnn at concurrency 1 and 64 again over the Open Inference
Protocol, HTTP (binary tensors) and gRPC, with bench/oip_loadgen.py, the same closed
loop. The table gives each target's ratio; JSON lines are appended to
bench/results/matrix.jsonl.

Targets (on a 2-core CPU machine):
  T1 mlp C=1 p50 <= in-process batch-1 p50 + 2 x echo p50 + 0.15 ms
  T2 cnn C=64 samples/s >= 0.85 x best in-process samples/s (batch 1..32)
  T3 mlp C=64 samples/s >= 0.6 x in-process samples/s at batch 32
  T4 echo 16 MB C=4 bytes/s >= 0.6 x bare ZeroMQ echo bytes/s
  T5 mlp and cnn C=64: p99 <= 2.5 x p50
  O1 OIP, mlp and cnn C=64: samples/s >= 0.5 x the ZeroMQ path's over HTTP, >= 0.3 x over gRPC
  O2 OIP HTTP and gRPC, mlp and cnn C=1: p50 <= the ZeroMQ path's p50 + 0.3 ms
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from bench import models
from bench.common import ROOT, cpu_seconds, record, run_loadgen, run_oip_loadgen, start_daemon, table
from inferd.harness import free_port

CONFIGS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (streams, CPU workers)
IDLE_S = 5.0
ECHO_1MB, ECHO_16MB = models.ECHO_SIZES["1MB"] // 4, models.ECHO_SIZES["16MB"] // 4


def model_configs(repo: Path) -> dict[str, dict[str, Any]]:
    """What one daemon of the matrix serves."""
    def spec(name: str, shape: tuple[int, ...], batch: int, folder: str | None = None) -> dict[str, Any]:
        return {"repository": str(repo / (folder or name)), "inputs": [{"dtype": "float32", "shape": list(shape)}],
                "max_batch_size": batch, "warmup_batch_sizes": sorted({1, batch})}

    return {
        "mlp": spec("mlp", models.MLP_SHAPE, 32),
        "cnn": spec("cnn", models.CNN_SHAPE, 16),
        "echo1m": spec("echo1m", (ECHO_1MB,), 4, "echo"),
        "echo16m": spec("echo16m", (ECHO_16MB,), 1, "echo"),
    }


CASES = [  # (name, model, per-sample shape, concurrency)
    ("mlp C=1", "mlp", models.MLP_SHAPE, 1),
    ("mlp C=64", "mlp", models.MLP_SHAPE, 64),
    ("cnn C=1", "cnn", models.CNN_SHAPE, 1),
    ("cnn C=64", "cnn", models.CNN_SHAPE, 64),
    ("echo 1MB C=4", "echo1m", (ECHO_1MB,), 4),
    ("echo 16MB C=4", "echo16m", (ECHO_16MB,), 4),
]
OIP_CASES = CASES[:4]  # mlp and cnn, C=1 and C=64
PROTOCOLS = ("http", "grpc")


def in_process(repo: Path, name: str, shape: tuple[int, ...], seconds: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.inprocess", str(repo / name / "v1" / "model.pt"),
                          "--shape", ",".join(map(str, shape)), "--seconds", str(seconds)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def bare_echo(seconds: float) -> dict[str, dict[str, Any]]:
    """The transport reference for each payload the matrix sends."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "bench.echo", endpoint], cwd=ROOT)
    try:
        return {
            name: run_loadgen(endpoint, model, shape, concurrency, seconds)
            for name, model, shape, concurrency in CASES
            if name in ("mlp C=1", "mlp C=64", "echo 16MB C=4")
        }
    finally:
        server.kill()
        server.wait()


def _answered_and_batches(daemon, model: str) -> tuple[int, Counter[int]]:
    """Requests answered and batches by size, since the daemon started."""
    stats = daemon.call("stats")["models"][model]
    distribution = stats["batch_size"]["distribution"]
    return sum(stats["requests"].values()), Counter({int(size): n for size, n in distribution.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    parser.add_argument("--quick", action="store_true", help="only streams 2, one worker")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    repo = workdir / "repo"
    models.build(repo)

    rows: list[dict[str, Any]] = []
    echo = bare_echo(args.seconds)
    rows.append({"kind": "reference", "echo": echo})
    model_references: dict[tuple[int, int], dict[str, Any]] = {}
    for streams, workers in CONFIGS[1:2] if args.quick else CONFIGS:
        front_ends = {name: f"127.0.0.1:{free_port()}" for name in PROTOCOLS}
        daemon = start_daemon(workdir / f"s{streams}w{workers}", model_configs(repo), server=front_ends,
                              workers={"streams": streams, "devices": ["cpu"] * workers, "shm_mb": 320})
        try:
            # The models in-process, right before the cases they are the reference of (the daemon
            # idle meanwhile): on a shared machine, one measured minutes apart drifts by tens of percent.
            references = {"mlp": in_process(repo, "mlp", models.MLP_SHAPE, 1.0),
                          "cnn": in_process(repo, "cnn", models.CNN_SHAPE, 1.0)}
            model_references[(streams, workers)] = references
            rows.append({"kind": "reference", "streams": streams, "workers": workers, **references})
            supervisor = psutil.Process(daemon.process.pid)
            gateways = [p for p in supervisor.children() if p.cmdline()[0].startswith("inferd: gateway")]
            processes = [supervisor, *gateways, *(psutil.Process(w["pid"]) for w in daemon.status()["workers"])]
            before = sum(cpu_seconds(processes))
            time.sleep(IDLE_S)
            idle_percent = (sum(cpu_seconds(processes)) - before) / IDLE_S * 100
            rows.append({"kind": "idle", "streams": streams, "workers": workers,
                         "cpu_percent_of_one_core": round(idle_percent, 2)})
            runs = [("zeromq", case) for case in CASES] + [(name, case) for name in PROTOCOLS for case in OIP_CASES]
            for protocol_name, (name, model, shape, concurrency) in runs:
                before = cpu_seconds(processes)
                answered_before, batches_before = _answered_and_batches(daemon, model)
                if protocol_name == "zeromq":
                    result = run_loadgen(daemon.endpoint, model, shape, concurrency, args.seconds)
                else:
                    result = run_oip_loadgen(protocol_name, front_ends[protocol_name], model, shape, concurrency,
                                             args.seconds)
                supervisor_s, *rest = (a - b for a, b in zip(cpu_seconds(processes), before))
                gateways_s, workers_s = rest[:len(gateways)], rest[len(gateways):]
                answered, batches = _answered_and_batches(daemon, model)
                batches -= batches_before
                requests = max(1, answered - answered_before)
                rows.append({"kind": "inferd", "protocol": protocol_name, "case": name, "streams": streams,
                             "workers": workers, **result,
                             "mean_batch": round(sum(s * n for s, n in batches.items()) / max(1, batches.total()), 2),
                             "supervisor_cpu_us_per_request": round(supervisor_s / requests * 1e6, 1),
                             "gateway_cpu_us_per_request": round(sum(gateways_s) / requests * 1e6, 1),
                             "worker_cpu_us_per_request": round(sum(workers_s) / requests * 1e6, 1)})
        finally:
            daemon.stop()
    record("matrix", rows)
    print()
    print(render(echo, model_references, [r for r in rows if r["kind"] == "inferd"]))
    idle = [r["cpu_percent_of_one_core"] for r in rows if r["kind"] == "idle"]
    print(f"\nidle daemon (supervisor, gateways and workers, {IDLE_S:g} s): {max(idle):.2f} % of one core at most")
    return 0


# O1 per front end: a gRPC request costs its gateway and its client about twice what an HTTP one does.
O1_RATIO = {"http": 0.5, "grpc": 0.3}


def render(echo: dict[str, Any], model_references: dict[tuple[int, int], dict[str, Any]],
           runs: list[dict[str, Any]]) -> str:
    """The results table, each target's ratio against the references of its configuration."""
    transport = 2 * echo["mlp C=1"]["latency_ms"]["p50"] + 0.15
    lines = []
    zeromq = {(r["case"], r["streams"], r["workers"]): r for r in runs if r["protocol"] == "zeromq"}
    for run in runs:
        case, latency = run["case"], run["latency_ms"]
        references = model_references[(run["streams"], run["workers"])]
        mlp, cnn = references["mlp"], references["cnn"]
        same = zeromq[(case, run["streams"], run["workers"])]
        if run["protocol"] != "zeromq" and case.endswith("C=1"):
            limit = same["latency_ms"]["p50"] + 0.3
            target, ok = f"O2 p50 {latency['p50']:.3f} <= ZeroMQ's + 0.3 = {limit:.3f} ms", latency["p50"] <= limit
        elif run["protocol"] != "zeromq":
            ratio, wanted = run["samples_per_s"] / same["samples_per_s"], O1_RATIO[run["protocol"]]
            target, ok = f"O1 {ratio:.2f} x ZeroMQ's samples/s (>= {wanted:g})", ratio >= wanted
        elif case == "mlp C=1":
            limit = mlp["batch1_latency_ms"]["p50"] + transport
            idle_limit = mlp["batch1_after_idle_latency_ms"]["p50"] + transport
            target = (f"T1 p50 {latency['p50']:.3f} <= {limit:.3f} ms "
                      f"(with the after-idle model time: <= {idle_limit:.3f})")
            ok = latency["p50"] <= limit
        elif case == "mlp C=64":
            ratio = run["samples_per_s"] / mlp["samples_per_s"]["32"]
            target, ok = f"T3 {ratio:.2f} x in-process b32 (>= 0.6)", ratio >= 0.6
        elif case == "cnn C=64":
            ratio = run["samples_per_s"] / cnn["best_samples_per_s"]
            target, ok = f"T2 {ratio:.2f} x best in-process (>= 0.85)", ratio >= 0.85
        elif case == "echo 16MB C=4":
            ratio = run["bytes_per_s"] / echo["echo 16MB C=4"]["bytes_per_s"]
            target, ok = f"T4 {ratio:.2f} x bare echo (>= 0.6)", ratio >= 0.6
        else:
            target, ok = "", None
        if case.endswith("C=64") and run["protocol"] == "zeromq":
            tail = latency["p99"] / latency["p50"]
            target += f"; T5 p99/p50 {tail:.2f} (<= 2.5)"
            ok = ok and tail <= 2.5
        lines.append([run["protocol"], case, run["streams"], run["workers"], run["samples_per_s"],
                      f"{run['bytes_per_s'] / 2**20:.0f}", latency["p50"], latency["p99"], run["mean_batch"],
                      run["supervisor_cpu_us_per_request"], run["gateway_cpu_us_per_request"],
                      run["worker_cpu_us_per_request"],
                      run["cpu_us_per_request"], target, {True: "met", False: "MISSED", None: ""}[ok]])
    header = ["protocol", "case", "streams", "workers", "samples/s", "MiB/s", "p50 ms", "p99 ms", "mean batch",
              "CPU us/request: supervisor", "gateway", "workers", "load generator", "target", ""]
    refs = [f"bare echo: p50 {echo['mlp C=1']['latency_ms']['p50']} ms (1 KB), "
            f"{echo['mlp C=64']['samples_per_s']} req/s at C=64, "
            f"{echo['echo 16MB C=4']['bytes_per_s'] / 2**20:.0f} MiB/s (16 MB)"]
    for (streams, workers), references in model_references.items():
        mlp, cnn = references["mlp"], references["cnn"]
        refs.append(f"in-process before streams {streams}, workers {workers}: mlp batch-1 p50 "
                    f"{mlp['batch1_latency_ms']['p50']} ms back to back, {mlp['batch1_after_idle_latency_ms']['p50']} "
                    f"ms after 1 ms idle, b32 {mlp['samples_per_s']['32']} samples/s; "
                    f"cnn best {cnn['best_samples_per_s']} samples/s")
    return "references:\n" + "\n".join(refs) + "\n\n" + table(header, lines)


if __name__ == "__main__":
    raise SystemExit(main())
