"""The model formats beside each other: TorchScript, a torch.export program (as exported, and compiled with
compile = "inductor") and an AOTInductor package of the same weights, each in-process and through inferd,
measured in one run.

    python -m bench.formats [--seconds 5]

For the benchmark mlp and cnn: how long exporting and compiling took, then per format the model in-process
(batch-1 p50, and the best samples/s over batch sizes up to max_batch_size, one torch thread as the worker
has) and through inferd (one CPU worker, streams 2) at concurrency 1 and 64: samples/s, p50, p99, the
workers' CPU per sample, and the worker's load and warm-up seconds (inductor compiles in the warm-up; the
in-process "inductor" figures are torch.compile's of the same program). AOTInductor again on two CPU
workers of one stream each ("aoti 2x1"): its Python binding holds the GIL while it computes, so a worker
runs it on one executor, on the threads of all its executors, where two processes compute side by side.
Targets, as ratios to TorchScript measured in the same run:
  F1 through inferd, each format's C=64 samples/s ratio to TorchScript's within 10 % of its in-process ratio
  F2 the best format's cnn C=64 samples/s >= 1.2 x TorchScript's
JSON lines are appended to bench/results/formats.jsonl.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from bench import models
from bench.common import ROOT, record, run_loadgen, start_daemon, table
from inferd.harness import DaemonProcess

FORMATS = ("torchscript", "exported", "aoti")  # the files built
SERVED = ("torchscript", "exported", "inductor", "aoti")  # inductor: the exported program with compile = "inductor"
MODELS = {"mlp": (models.MLP_SHAPE, 32), "cnn": (models.CNN_SHAPE, 16)}  # per-sample shape, max_batch_size


def build(repo: Path, name: str, shape: tuple[int, ...], max_batch: int) -> dict[str, float]:
    """Versions of `name` in each format, from the same weights (torchscript/, exported/, aoti/ under
    repo/NAME); the seconds exporting and compiling took."""
    torch.manual_seed(0)
    module = {"mlp": models.mlp, "cnn": models.cnn}[name]().eval()
    folder = repo / name
    for version in FORMATS:
        (folder / version).mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module), str(folder / "torchscript" / "model.pt"))
    example = (torch.randn(2, *shape),)
    started = time.perf_counter()
    program = torch.export.export(module, example, dynamic_shapes=({0: torch.export.Dim("batch", max=max_batch)},))
    exported = time.perf_counter()
    torch.export.save(program, str(folder / "exported" / "model.pt2"))
    torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "aoti" / "model.pt2"))
    return {"export_s": round(exported - started, 2), "aoti_compile_s": round(time.perf_counter() - exported, 2)}


def in_process(path: Path, shape: tuple[int, ...], max_batch: int, seconds: float, device: str = "cpu",
               dtype: str = "float32", compile_it: bool = False) -> dict[str, Any]:
    """bench.inprocess's figures for the model in `path`, in a process of its own."""
    out = subprocess.run([sys.executable, "-m", "bench.inprocess", str(path), "--shape", ",".join(map(str, shape)),
                          "--max-batch", str(max_batch), "--seconds", str(seconds), "--device", device,
                          "--dtype", dtype, *(["--compile"] if compile_it else [])],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def served(workdir: Path, repo: Path, name: str, version: str, shape: tuple[int, ...], max_batch: int,
           seconds: float, workers: int = 1, streams: int = 2, *, device: str = "cpu", dtype: str = "float32",
           settings: dict[str, Any] | None = None, concurrencies: tuple[int, ...] = (1, 64),
           label: str = "", start_timeout: float = 120) -> dict[str, Any]:
    """The version served by its own daemon (`workers` on `device`, with the model's extra `settings`) at each
    of `concurrencies`, with its load line, the workers' CPU per sample and the mean batch size."""
    spec = {"repository": str(repo / name), "version": version, "inputs": [{"dtype": dtype, "shape": list(shape)}],
            "max_batch_size": max_batch, "warmup_batch_sizes": sorted({1, max_batch}), **(settings or {})}
    daemon = start_daemon(workdir / f"{name}-{version}-{workers}x{streams}{label}", {name: spec}, start_timeout,
                          workers={"streams": streams, "shm_mb": 128 if device == "cpu" else 2048,
                                   "devices": [device] * workers})
    try:
        loaded = next(line for line in daemon.log().splitlines() if f"loaded {name} {version}" in line)
        processes = [psutil.Process(w["pid"]) for w in daemon.status()["workers"]]
        result: dict[str, Any] = {"load_line": loaded.split("INFO ", 1)[-1], "workers": workers, "streams": streams}
        for concurrency in concurrencies:
            before = sum(sum(p.cpu_times()[:2]) for p in processes)
            samples_before, batches_before = served_counts(daemon, name)
            run = run_loadgen(daemon.endpoint, name, shape, concurrency, seconds, dtype=dtype)
            cpu = sum(sum(p.cpu_times()[:2]) for p in processes) - before
            samples_after, batches_after = served_counts(daemon, name)
            samples = max(1.0, run["samples_per_s"] * seconds)
            result[f"c{concurrency}"] = {
                "samples_per_s": run["samples_per_s"], "latency_ms": run["latency_ms"],
                "worker_cpu_us_per_sample": round(cpu / samples * 1e6, 1),
                "mean_batch": round((samples_after - samples_before) / max(1, batches_after - batches_before), 2)}
        return result
    finally:
        daemon.stop()


def format_rows(workdir: Path, repo: Path, name: str, shape: tuple[int, ...], max_batch: int, seconds: float,
                made: dict[str, float], device: str = "cpu", dtype: str = "float32") -> list[dict[str, Any]]:
    """A row per served format of model `name` (built by `build`): in-process and through inferd (one worker,
    streams 2, on `device`). A compile (inductor's) is in the daemon's start: it may take minutes."""
    rows = []
    for form in SERVED:
        version = "exported" if form == "inductor" else form
        path = next((repo / name / version).glob("model.pt*"))
        compiles = form == "inductor"
        rows.append({"model": name, "format": form, **(made if form == "aoti" else {}),
                     "in_process": in_process(path, shape, max_batch, 1.0, device, dtype, compile_it=compiles),
                     "inferd": served(workdir, repo, name, version, shape, max_batch, seconds, device=device,
                                      dtype=dtype, settings={"compile": "inductor"} if compiles else None,
                                      label=f"-{form}", start_timeout=900 if compiles else 120)})
    return rows


def served_counts(daemon: DaemonProcess, name: str) -> tuple[int, int]:
    """The samples and batches the daemon has computed of model `name`."""
    report = daemon.call("stats")["models"][name]
    return report["samples"], sum(report["batch_size"]["distribution"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-formats-"))
    repo = workdir / "repo"
    rows: list[dict[str, Any]] = []
    for name, (shape, max_batch) in MODELS.items():
        made = build(repo, name, shape, max_batch)
        rows += format_rows(workdir, repo, name, shape, max_batch, args.seconds, made)
        alone = rows[-1]["in_process"]
        rows.append({"model": name, "format": "aoti 2x1", "in_process": alone,
                     "inferd": served(workdir, repo, name, "aoti", shape, max_batch, args.seconds, workers=2,
                                      streams=1)})
    record("formats", rows)
    print()
    print(render(rows))
    return 0


def load_and_warm(line: str) -> str:
    """A worker's load line as "LOAD + WARM" seconds (a compile with inductor is in the warm-up)."""
    found = re.search(r" in ([0-9.]+) s, warmed on batch sizes .* in ([0-9.]+) s", line)
    return f"{found[1]} + {found[2]}" if found else "?"


def render(rows: list[dict[str, Any]]) -> str:
    """The table: each format's figures and its ratio to TorchScript, in-process and through inferd."""
    lines = []
    base = {(r["model"]): r for r in rows if r["format"] == "torchscript"}
    best_cnn = max((r for r in rows if r["model"] == "cnn"), key=lambda r: r["inferd"]["c64"]["samples_per_s"])
    for r in rows:
        ts = base[r["model"]]
        inproc = r["in_process"]["best_samples_per_s"] / ts["in_process"]["best_samples_per_s"]
        served_ratio = r["inferd"]["c64"]["samples_per_s"] / ts["inferd"]["c64"]["samples_per_s"]
        f1 = "" if r["format"] == "torchscript" else (
            f"F1 {'met' if abs(served_ratio / inproc - 1) <= 0.10 else 'missed'}")
        lines.append([r["model"], r["format"], r["in_process"]["batch1_latency_ms"]["p50"],
                      r["in_process"]["best_samples_per_s"], f"{inproc:.2f} x",
                      r["inferd"]["c1"]["latency_ms"]["p50"], r["inferd"]["c64"]["samples_per_s"],
                      r["inferd"]["c64"]["latency_ms"]["p99"], r["inferd"]["c64"]["worker_cpu_us_per_sample"],
                      f"{served_ratio:.2f} x", f1, load_and_warm(r["inferd"]["load_line"])])
    f2 = best_cnn["inferd"]["c64"]["samples_per_s"] / base["cnn"]["inferd"]["c64"]["samples_per_s"]
    compile_note = "; ".join(f"{r['model']}: export {r['export_s']} s, AOTInductor compile {r['aoti_compile_s']} s"
                             for r in rows if "aoti_compile_s" in r)
    return table(["model", "format", "in-process b1 p50 ms", "in-process best/s", "vs TS", "inferd C=1 p50 ms",
                  "inferd C=64 /s", "C=64 p99 ms", "worker CPU us/sample", "vs TS", "target",
                  "worker load + warm-up s"], lines) + (
        f"\nF2 best cnn format ({best_cnn['format']}) at C=64: {f2:.2f} x TorchScript "
        f"({'met' if f2 >= 1.2 else 'missed'}, target 1.2 x)\n{compile_note}")


if __name__ == "__main__":
    raise SystemExit(main())
