"""What a Python model costs: the daemon's CPU per request against a tensor model's, and how its processes scale.

    python -m bench.steps [--runs 3] [--seconds 5] [--loops 40000]

1. One daemon serves two identity models of the same size (float32 [256] in, the same out): `echo`, a TorchScript
   module on the CPU worker, and `pyecho`, a Python model (model.py) on one step process; both with one executor
   (workers.streams = 1) and max_batch_size 64, and server.spin_us = 0 (the loop's wait for the next request
   would otherwise count as work). The load generator keeps 1, then 64, requests in flight on each,
   alternately, and each run prints the CPU time every process of the daemon (supervisor, worker, step) spent
   per request answered. Target: the Python model at most 1.5x the tensor model's.
2. Another daemon serves a CPU-bound Python model (`busy`: a Python loop of `--loops` steps per sample, as a
   tokenizer's or an image decoder's work is) twice, with processes = 1 and 2; 64 requests in flight on each in
   turn. Target: two processes at least 1.7x the samples per second of one, where the step is the bottleneck.

Each run appends its JSON lines to bench/results/steps.jsonl, with the machine's load average (a busy machine
leaves the two processes less than two cores); the table at the end gives the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from bench import models
from bench.common import record, run_loadgen, start_daemon, table
from inferd.harness import DaemonProcess

IDENTITY = '''
class Model:
    """The identity: what comes in goes out, the same array (no copy)."""

    def __call__(self, inputs):
        return {"OUTPUT__0": inputs["INPUT__0"]}
'''

BUSY = '''
class Model:
    """A Python loop per sample: CPU-bound work that holds the GIL, as a tokenizer's or a decoder's does."""

    def __init__(self, context):
        self.loops = int(context.parameters["loops"])

    def __call__(self, inputs):
        x = inputs["INPUT__0"]
        total = 0
        for _ in range(self.loops * len(x)):
            total += 1
        return {"OUTPUT__0": x + total * 0.0}
'''

SHAPE = models.MLP_SHAPE  # float32 [256]
ONE = (1,)


def python_model(root: Path, name: str, source: str) -> Path:
    """A repository holding `source` as NAME/v1/model.py."""
    folder = root / name / "v1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(source)
    return root / name


def daemon_cpu_s(daemon: DaemonProcess) -> float:
    """CPU seconds the daemon's processes (the supervisor and all it started) have used so far."""
    supervisor = psutil.Process(daemon.process.pid)
    total = 0.0
    for process in [supervisor, *supervisor.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def answered(daemon: DaemonProcess) -> int:
    return sum(daemon.status()["replies"].values())


def cpu_per_request(daemon: DaemonProcess, model: str, shape: tuple[int, ...], concurrency: int,
                    seconds: float) -> dict[str, Any]:
    """One run: the daemon's CPU per request answered, in microseconds, and the load generator's line."""
    before_cpu, before = daemon_cpu_s(daemon), answered(daemon)
    result = run_loadgen(daemon.endpoint, model, shape, concurrency, seconds, warmup=0.0)
    requests = answered(daemon) - before
    used = daemon_cpu_s(daemon) - before_cpu
    return {"daemon_cpu_us_per_request": round(used / requests * 1e6, 1), "requests": requests,
            "samples_per_s": result["samples_per_s"], "p50_ms": result["latency_ms"]["p50"],
            "load_average": round(os.getloadavg()[0], 2)}


def overhead(root: Path, runs: int, seconds: float) -> list[dict[str, Any]]:
    """Part 1: the identity as a tensor model and as a Python model, at C=1 and C=64, alternately."""
    models.build(root / "repo")
    batching = {"inputs": [{"dtype": "float32", "shape": list(SHAPE)}], "max_batch_size": 64,
                "warmup_batch_sizes": [1, 64]}
    served = {
        "echo": {**batching, "repository": str(root / "repo" / "echo")},
        "pyecho": {**batching, "repository": str(python_model(root / "python", "pyecho", IDENTITY)),
                   "outputs": [{"name": "OUTPUT__0", "dtype": "float32", "shape": list(SHAPE)}]},
    }
    daemon = start_daemon(root / "identity", served, workers={"devices": ["cpu"], "streams": 1},
                          server={"spin_us": 0})
    rows = []
    try:
        for model in served:
            run_loadgen(daemon.endpoint, model, SHAPE, 64, 2.0)  # warm
        for run in range(runs):
            for concurrency in (1, 64):
                for model in served:
                    row = {"part": "overhead", "model": model, "kind": "tensor" if model == "echo" else "python",
                           "concurrency": concurrency, "run": run,
                           **cpu_per_request(daemon, model, SHAPE, concurrency, seconds)}
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    finally:
        daemon.stop()
    return rows


def scaling(root: Path, runs: int, seconds: float, loops: int) -> list[dict[str, Any]]:
    """Part 2: a CPU-bound Python model with one process, then two, 64 requests in flight."""
    repository = python_model(root / "python", "busy", BUSY)
    busy = {"repository": str(repository), "inputs": [{"dtype": "float32", "shape": [1]}], "max_batch_size": 8,
            "outputs": [{"name": "OUTPUT__0", "dtype": "float32", "shape": [1]}], "parameters": {"loops": loops}}
    served = {"busy1": {**busy, "processes": 1}, "busy2": {**busy, "processes": 2}}
    # No tensor model is asked for; the worker (there always is one) only answers its pings.
    daemon = start_daemon(root / "busy", {**served, "echo": {"repository": str(root / "repo" / "echo"),
                                                             "inputs": [{"dtype": "float32", "shape": list(SHAPE)}]}},
                          workers={"devices": ["cpu"], "streams": 1})
    rows = []
    try:
        for model in served:
            run_loadgen(daemon.endpoint, model, ONE, 64, 2.0)  # warm
        for run in range(runs):
            for model, processes in (("busy1", 1), ("busy2", 2)):
                result = run_loadgen(daemon.endpoint, model, ONE, 64, seconds, warmup=0.5)
                row = {"part": "scaling", "model": model, "processes": processes, "loops": loops, "run": run,
                       "samples_per_s": result["samples_per_s"], "p50_ms": result["latency_ms"]["p50"],
                       "load_average": round(os.getloadavg()[0], 2)}
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    finally:
        daemon.stop()
    return rows


def median(rows: list[dict[str, Any]], key: str, **where: Any) -> float:
    return statistics.median(r[key] for r in rows if all(r.get(k) == v for k, v in where.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--loops", type=int, default=40000, help="Python loop steps per sample of the busy model")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inferd-steps-"))
    rows = overhead(root, args.runs, args.seconds) + scaling(root, args.runs, args.seconds, args.loops)
    record("steps", rows)
    lines = []
    for concurrency in (1, 64):
        tensor = median(rows, "daemon_cpu_us_per_request", model="echo", concurrency=concurrency)
        python = median(rows, "daemon_cpu_us_per_request", model="pyecho", concurrency=concurrency)
        lines.append([f"identity float32 [256], C={concurrency}", f"{tensor:.0f} µs", f"{python:.0f} µs",
                      f"{python / tensor:.2f}x (target <= 1.5x)"])
    one = median(rows, "samples_per_s", model="busy1")
    two = median(rows, "samples_per_s", model="busy2")
    lines.append([f"busy ({args.loops} loop steps a sample), C=64", f"{one:.0f} samples/s (1 process)",
                  f"{two:.0f} samples/s (2 processes)", f"{two / one:.2f}x (target >= 1.7x)"])
    print(table(["measure", "tensor model / 1 process", "Python model / 2 processes", "ratio"], lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
