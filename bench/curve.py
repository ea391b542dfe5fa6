"""Throughput against latency as concurrency grows: inferd with each batch window, and the model in-process.

    python -m bench.curve [--seconds 4] [--model mlp] [--windows 0,2,5,auto] [--levels 1,2,4,...]

Concurrency 1, 2, 4, 8, 16, 32, 64, 128 (--levels: fewer, for a quick look). inferd runs once per batch window
(`max_wait_ms` 0, 2 and 5 ms and "auto"), each window in a daemon of its own;
the daemons are all started first (an idle one costs no CPU) and at each
concurrency the windows run one after another, in an order that rotates from
one concurrency to the next, so the machine's drift (tens of percent within
minutes on a shared one) falls on all windows alike rather than on the one
measured last. The in-process reference at concurrency C runs the model on
batches of min(C, max_batch_size) in a loop (what a perfect server would do
with C waiting).

Target (the issue's): at every concurrency "auto" is within 10 % of the best
fixed window's throughput at no worse p99. Judged per concurrency as: take the
fixed window with the highest samples/s there ("best"); met when auto's
samples/s >= 0.9 x best's AND auto's p99 <= best's p99 (x 1.0, no tolerance).
p99 on a 2-core machine shared with other tenants is noisy, so the table also
gives auto's p99 / best's p99, to read a narrow miss for what it is.

Saves the JSON lines (bench/results/curve-MODEL.jsonl) and a PNG
(bench/results/curve-MODEL.png: throughput against p99, one line per window,
and the in-process reference).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import models
from bench.common import RESULTS, record, run_loadgen, start_daemon, table
from bench.run import model_configs

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
WINDOWS: tuple[float | str, ...] = (0, 2, 5, "auto")
THROUGHPUT_SHARE = 0.9  # auto's samples/s at least this share of the best fixed window's
P99_FACTOR = 1.0  # auto's p99 at most this times the best fixed window's


def in_process_curve(path: Path, shape: tuple[int, ...], max_batch: int, seconds: float,
                     levels: tuple[int, ...] = LEVELS) -> list[dict]:
    """For each concurrency: samples/s and per-request latency when batches of min(C, max_batch) run back to back."""
    code = f"""
import json, time, numpy as np, torch
torch.set_num_threads(1)
m = torch.jit.load({str(path)!r}).eval()
out = []
with torch.inference_mode():
    for c in {list(levels)!r}:
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


def window_name(window: float | str) -> str:
    """How a window reads in the table, the JSON lines and the legend."""
    return "auto" if window == "auto" else f"{window:g} ms"


def parse_windows(text: str) -> list[float | str]:
    """--windows: numbers of ms and "auto", comma-separated."""
    return [w if w == "auto" else float(w) for w in (part.strip() for part in text.split(",")) if w]


def judge(rows: list[dict[str, Any]], windows: list[float | str], levels: tuple[int, ...] = LEVELS
          ) -> list[dict[str, Any]]:
    """Per concurrency: each window's samples/s and p99, the best fixed window, and auto against it."""
    by = {(r["window"], r["concurrency"]): r for r in rows if r["system"] == "inferd"}
    fixed = [window_name(w) for w in windows if w != "auto"]
    verdicts = []
    for level in levels:
        verdict: dict[str, Any] = {"kind": "verdict", "concurrency": level}
        measured = [by[(name, level)] for name in fixed if (name, level) in by]
        auto = by.get(("auto", level))
        if measured:
            best = max(measured, key=lambda r: r["samples_per_s"])
            verdict.update(best_fixed=best["window"], best_samples_per_s=best["samples_per_s"],
                           best_p99=best["p99"])
            if auto is not None:
                throughput_ratio = auto["samples_per_s"] / best["samples_per_s"] if best["samples_per_s"] else 0.0
                p99_ratio = auto["p99"] / best["p99"] if best["p99"] else float("inf")
                verdict.update(auto_samples_per_s=auto["samples_per_s"], auto_p99=auto["p99"],
                               throughput_ratio=round(throughput_ratio, 3), p99_ratio=round(p99_ratio, 3),
                               met=throughput_ratio >= THROUGHPUT_SHARE and p99_ratio <= P99_FACTOR)
        verdicts.append(verdict)
    return verdicts


def render(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]], windows: list[float | str]) -> str:
    """One row per concurrency: each window's samples/s and p99, the in-process reference, auto's verdict."""
    by = {(r["window"], r["concurrency"]): r for r in rows if r["system"] == "inferd"}
    reference = {r["concurrency"]: r for r in rows if r["system"] == "in-process"}
    names = [window_name(w) for w in windows]
    header = ["C", *(f"{n}: samples/s / p99 ms" for n in names), "in-process samples/s / p99 ms",
              "best fixed", "auto / best samples/s", "auto / best p99", "target"]
    lines = []
    for verdict in verdicts:
        level = verdict["concurrency"]
        cells = [level]
        for name in names:
            r = by.get((name, level))
            cells.append(f"{r['samples_per_s']:.0f} / {r['p99']:.2f}" if r else "")
        ref = reference.get(level)
        cells.append(f"{ref['samples_per_s']:.0f} / {ref['p99']:.2f}" if ref else "")
        cells.append(verdict.get("best_fixed", ""))
        if "met" in verdict:
            cells += [f"{verdict['throughput_ratio']:.2f} (>= {THROUGHPUT_SHARE})",
                      f"{verdict['p99_ratio']:.2f} (<= {P99_FACTOR:g})", "met" if verdict["met"] else "MISSED"]
        else:
            cells += ["", "", ""]
        lines.append(cells)
    return table(header, lines)


def plot(rows: list[dict], model: str, windows: list[float | str], path: Path) -> None:
    """Throughput on x, p99 latency on y (log): one line per window, and the in-process reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"])
    series = [(window_name(w), "inferd", "-o" if w != "auto" else "-D") for w in windows]
    series.append(("in-process", "in-process", "--^"))
    for name, system, style in series:
        points = sorted((r for r in rows if r["system"] == system and (system != "inferd" or r["window"] == name)),
                        key=lambda r: r["concurrency"])
        if not points:
            continue
        color = "tab:gray" if system == "in-process" else ("tab:red" if name == "auto" else next(colors))
        label = "in-process" if system == "in-process" else f"max_wait_ms {name}"
        axis.plot([r["samples_per_s"] for r in points], [r["p99"] for r in points], style, color=color,
                  label=label, linewidth=2.2 if name == "auto" else 1.3, markersize=4)
        if name == "auto" or system == "in-process":
            for r in points:
                axis.annotate(f"C={r['concurrency']}", (r["samples_per_s"], r["p99"]), fontsize=7, color=color,
                              textcoords="offset points", xytext=(3, -9))
    axis.set_xlabel("throughput (samples/s)")
    axis.set_ylabel("p99 latency (ms, log)")
    axis.set_yscale("log")
    levels = sorted({r["concurrency"] for r in rows})
    axis.set_title(f"{model}: throughput against p99 per batch window, concurrency {levels[0]}..{levels[-1]} "
                   "(2-core CPU)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="of each load generator run")
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--windows", type=parse_windows, default=list(WINDOWS),
                        help='max_wait_ms values, comma-separated, "auto" among them (default 0,2,5,auto)')
    parser.add_argument("--levels", type=lambda t: tuple(int(c) for c in t.split(",")), default=LEVELS,
                        help="concurrency levels, comma-separated (default 1,2,4,8,16,32,64,128)")
    args = parser.parse_args()
    levels: tuple[int, ...] = args.levels
    windows: list[float | str] = args.windows
    shape = {"mlp": models.MLP_SHAPE, "cnn": models.CNN_SHAPE}[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    models.build(workdir / "repo")
    configs = model_configs(workdir / "repo")
    max_batch = configs[args.model]["max_batch_size"]
    rows: list[dict[str, Any]] = [
        {"system": "in-process", "model": args.model, **r}
        for r in in_process_curve(workdir / "repo" / args.model / "v1" / "model.pt", shape, max_batch, 1.5, levels)]
    daemons = {}
    try:
        for k, window in enumerate(windows):
            daemons[window_name(window)] = start_daemon(
                workdir / f"daemon{k}", {args.model: {**configs[args.model], "max_wait_ms": window}})
        names = list(daemons)
        for index, level in enumerate(levels):
            for name in names[index % len(names):] + names[:index % len(names)]:
                result = run_loadgen(daemons[name].endpoint, args.model, shape, level, args.seconds, warmup=1.0)
                rows.append({"system": "inferd", "model": args.model, "window": name, "concurrency": level,
                             "samples_per_s": result["samples_per_s"], "p50": result["latency_ms"]["p50"],
                             "p99": result["latency_ms"]["p99"], "statuses": result["statuses"]})
    finally:
        for daemon in daemons.values():
            daemon.stop()
    verdicts = judge(rows, windows, levels)
    record(f"curve-{args.model}", [*rows, *({"model": args.model, **v} for v in verdicts)])
    picture = RESULTS / f"curve-{args.model}.png"
    plot(rows, args.model, windows, picture)
    print()
    print(render(rows, verdicts, windows))
    judged = [v for v in verdicts if "met" in v]
    if judged:
        print(f"\n\"auto\" met the target at {sum(v['met'] for v in judged)} of {len(judged)} concurrency levels")
    print(f"\nsaved {picture} ({time.strftime('%Y-%m-%d %H:%M')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
