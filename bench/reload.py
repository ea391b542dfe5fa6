"""Latency and throughput in steady state and during reloads, from one run, side by side; or, with
--canary, live traffic without a trial, beside a 10 % canary, and beside a 5 % shadow.

    python -m bench.reload [--concurrency 16] [--seconds 30] [--every 2]
    python -m bench.reload --canary [--concurrency 16] [--seconds 10] [--rounds 3]

One daemon (one CPU worker, 2 streams, 1 torch thread) serves the benchmark
`mlp`. One load generator run drives it at the given concurrency while this
script reloads v2, v1, v2, ... one reload every `--every` seconds. Each request
is then put in the phase its send time fell in: inside a reload (from the
command to its answer) or steady. Goal: zero failures, and p99 during reloads
at most 2x the steady p99.

With --canary, the same daemon runs `--rounds` rounds of three phases, one load
generator run of `--seconds` each: no trial, v2 as a 10 % canary, v2 as a 5 %
shadow (a trial starts and ends between phases, outside the measurement). Each
phase's latencies are pooled over the rounds. Goal: live p99 with the shadow at
most 1.2x the p99 without; the canary phase shows what the canary's share costs
(v2 computes as fast as v1, so: nothing but its split).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import models
from bench.common import ROOT, loadgen_command, record, start_daemon, table
from bench.loadgen import percentiles
from inferd.ipc.control import ControlClient

MLP = {"inputs": [{"dtype": "float32", "shape": list(models.MLP_SHAPE)}], "max_batch_size": 32,
       "warmup_batch_sizes": [1, 8, 32], "version": "v1"}
WARMUP_S = 2.0


def phase_row(name: str, latency: np.ndarray, ok: np.ndarray, seconds: float, **extra) -> dict:
    """Measurements of the requests selected for one phase."""
    return {
        "phase": name,
        **extra,
        "requests": len(ok),
        "not_ok": int((~ok).sum()),
        "samples_per_s": round(float(ok.sum()) / seconds, 1) if seconds else 0.0,
        "latency_ms": percentiles(list(latency[ok])),
    }


def print_phases(rows: list[dict]) -> None:
    """The phases' rows as a table."""
    print()
    print(table(
        ["phase", "concurrency", "requests", "samples/s", "p50 ms", "p99 ms", "max ms", "not ok"],
        [[r["phase"], r["concurrency"], r["requests"], r["samples_per_s"], r["latency_ms"]["p50"],
          r["latency_ms"]["p99"], r["latency_ms"]["max"], r["not_ok"]] for r in rows],
    ))


TRIALS = (("no trial", {}), ("canary 10 %", {"canary": 10}), ("shadow 5 %", {"shadow": 5}))


def trials(args: argparse.Namespace) -> int:
    """Live traffic without a trial, beside a canary and beside a shadow, interleaved over rounds."""
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    models.build(workdir / "repo")
    daemon = start_daemon(workdir, {"mlp": {**MLP, "repository": str(workdir / "repo" / "mlp")}})
    pooled: dict[str, list[np.ndarray]] = {name: [] for name, _ in TRIALS}
    notes: dict[str, list[dict]] = {name: [] for name, _ in TRIALS}
    try:
        with ControlClient(daemon.control, timeout=120) as control:
            for round_ in range(args.rounds):
                for index, (name, trial) in enumerate(TRIALS):
                    if trial:
                        control.call("reload", version="v2", model="mlp", **trial)
                    trace = workdir / f"trace-{round_}-{index}.npz"
                    subprocess.run(loadgen_command(daemon.endpoint, "mlp", models.MLP_SHAPE, args.concurrency,
                                                   args.seconds, 1.0, trace), cwd=ROOT, check=True,
                                   stdout=subprocess.DEVNULL)
                    data = np.load(trace)
                    pooled[name].append(np.stack([data["latency"], data["ok"]]))
                    stats = control.call("stats")["models"]["mlp"]
                    notes[name].append({"candidate": stats["candidate"], "shadow": stats["shadow"].get("v2")})
                    if trial:
                        control.call("rollback", model="mlp", confirm=True)
    finally:
        daemon.stop()
    rows = []
    for name, _ in TRIALS:
        latency, ok = np.concatenate(pooled[name], axis=1)
        ok = ok.astype(bool)
        row = phase_row(name, latency, ok, args.seconds * args.rounds, concurrency=args.concurrency, model="mlp",
                        rounds=args.rounds)
        if name.startswith("shadow"):
            shadow = notes[name][-1]["shadow"]  # cumulative since start: the last round's holds them all
            row["shadow"] = {key: shadow[key] for key in ("chosen", "compared", "dropped", "allclose_share")}
        if name.startswith("canary"):
            row["routed_share"] = [n["candidate"]["routed_share"] for n in notes[name]]
        rows.append(row)
    record("canary", rows)
    print_phases(rows)
    base, canary, shadow = (r["latency_ms"]["p99"] for r in rows)
    print(f"\nshadow work: {rows[2]['shadow']}")
    print(f"p99 with a 10 % canary / without = {canary / base:.2f}; "
          f"p99 with a 5 % shadow / without = {shadow / base:.2f} (goal: at most 1.2)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=None, help="the run's length [30]; with --canary, "
                        "each phase's [10]")
    parser.add_argument("--every", type=float, default=2.0, help="seconds from one reload's start to the next")
    parser.add_argument("--canary", action="store_true", help="measure canary and shadow, not reloads")
    parser.add_argument("--rounds", type=int, default=3, help="with --canary: rounds of the three phases")
    args = parser.parse_args()
    if args.canary:
        args.seconds = args.seconds or 10.0
        return trials(args)
    args.seconds = args.seconds or 30.0
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    models.build(workdir / "repo")
    daemon = start_daemon(workdir, {"mlp": {**MLP, "repository": str(workdir / "repo" / "mlp")}})
    trace = workdir / "trace.npz"
    windows: list[tuple[float, float, dict]] = []
    try:
        load = subprocess.Popen(
            loadgen_command(daemon.endpoint, "mlp", models.MLP_SHAPE, args.concurrency, args.seconds, WARMUP_S, trace),
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        time.sleep(WARMUP_S + args.every / 2)
        version = "v1"
        with ControlClient(daemon.control, timeout=120) as control:
            while load.poll() is None:
                version = "v2" if version == "v1" else "v1"
                began = time.monotonic()
                result = control.call("reload", version=version, model="mlp")
                windows.append((began, time.monotonic(), result))
                time.sleep(max(0.0, args.every - (time.monotonic() - began)))
        overall = json.loads(load.stdout.read().strip().splitlines()[-1])
    finally:
        daemon.stop()
    data = np.load(trace)
    sent, latency, ok = data["sent"], data["latency"], data["ok"]
    inside = np.zeros(len(sent), dtype=bool)
    for began, ended, _ in windows:
        inside |= (sent >= began) & (sent < ended)
    reload_s = sum(min(e, sent.max()) - b for b, e, _ in windows if b < sent.max())
    steady = phase_row("steady", latency[~inside], ok[~inside], args.seconds - reload_s)
    during = phase_row("reloading", latency[inside], ok[inside], reload_s, reloads=len(windows),
                       mean_reload_s=round(float(np.mean([e - b for b, e, _ in windows])), 3))
    rows = [{**row, "concurrency": args.concurrency, "model": "mlp"} for row in (steady, during)]
    record("reload", rows)
    print_phases(rows)
    print(f"\n{len(windows)} reloads, {during['mean_reload_s']} s each on average; whole run: {overall['statuses']}")
    print("per reload (total s, load s, warm s, save ms): "
          + ", ".join(f"({r['total_s']}, {r['load_s']}, {r['warm_s']}, {r['save_ms']})" for _, _, r in windows))
    print(f"p99 during reloads / steady p99 = {during['latency_ms']['p99'] / steady['latency_ms']['p99']:.2f} "
          "(goal: at most 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
