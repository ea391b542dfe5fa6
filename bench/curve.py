"""Throughput against latency as concurrency grows, for inferd and the model in-process.

    python -m bench.curve [--seconds 4] [--model mlp]

Concurrency 1, 2, 4, 8, 16, 32, 64, 128. The in-process reference at
concurrency C runs the model on batches of min(C, max_batch_size) in a loop
(what a perfect server would do with C waiting). Saves the JSON lines and a PNG
(throughput against p50 and p99 latency) in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import models
from bench.common import RESULTS, record, run_loadgen, start_daemon
from bench.run import model_configs

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)


def in_process_curve(path: Path, shape: tuple[int, ...], max_batch: int, seconds: float) -> list[dict]:
    """For each concurrency: samples/s and per-request latency when batches of min(C, max_batch) run back to back."""
    code = f"""
import json, time, numpy as np, torch
torch.set_num_threads(1)
m = torch.jit.load({str(path)!r}).eval()
out = []
with torch.inference_mode():
    for c in {list(LEVELS)!r}:
        b = min(c, {max_batch})
        x = torch.randn(b, *{list(shape)!r})
        for _ in range(3): m(x)
        lat, done, start = [], 0, time.perf_counter()
        while time.perf_counter() - start < {seconds}:
            t = time.perf_counter(); m(x); lat.append(time.perf_counter() - t); done += b
        rounds = c / b  # requests beyond one batch wait for the batches before them
        ms = np.asarray(lat) * 1000 * rounds
        out.append({{"concurrency": c, "samples_per_s": done / (time.perf_counter() - start),
                     "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}})
print(json.dumps(out))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def plot(rows: list[dict], model: str, path: Path) -> None:
    """Throughput on x, p50 and p99 latency on y (log), one line per system and percentile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for system, color in (("inferd", "tab:blue"), ("in-process", "tab:gray")):
        points = sorted((r for r in rows if r["system"] == system), key=lambda r: r["concurrency"])
        x = [r["samples_per_s"] for r in points]
        for percentile, style in (("p50", "-o"), ("p99", "--^")):
            axis.plot(x, [r[percentile] for r in points], style, color=color, label=f"{system} {percentile}")
        for r in points:
            axis.annotate(f"C={r['concurrency']}", (r["samples_per_s"], r["p50"]), fontsize=7,
                          textcoords="offset points", xytext=(3, -9))
    axis.set_xlabel("throughput (samples/s)")
    axis.set_ylabel("latency (ms, log)")
    axis.set_yscale("log")
    axis.set_title(f"{model}: throughput against latency, concurrency 1..128 (2-core CPU)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    args = parser.parse_args()
    shape = {"mlp": models.MLP_SHAPE, "cnn": models.CNN_SHAPE}[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    models.build(workdir / "repo")
    configs = model_configs(workdir / "repo")
    max_batch = configs[args.model]["max_batch_size"]
    rows = [{"system": "in-process", "model": args.model, **r}
            for r in in_process_curve(workdir / "repo" / args.model / "v1" / "model.pt", shape, max_batch, 1.5)]
    daemon = start_daemon(workdir / "daemon", {args.model: configs[args.model]})
    try:
        for level in LEVELS:
            result = run_loadgen(daemon.endpoint, args.model, shape, level, args.seconds, warmup=1.0)
            rows.append({"system": "inferd", "model": args.model, "concurrency": level,
                         "samples_per_s": result["samples_per_s"], "p50": result["latency_ms"]["p50"],
                         "p99": result["latency_ms"]["p99"]})
    finally:
        daemon.stop()
    record(f"curve-{args.model}", rows)
    picture = RESULTS / f"curve-{args.model}.png"
    plot(rows, args.model, picture)
    print(f"\nsaved {picture} ({time.strftime('%Y-%m-%d %H:%M')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
