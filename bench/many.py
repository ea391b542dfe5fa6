"""Many on-demand models under a memory budget: 40 models of about 30 MB, traffic over them by a Zipf law.

    python -m bench.many [--seconds 60] [--models 40] [--hold 8]

One daemon (one CPU worker) serves MODELS models from a model_root, each `load = "on_demand"`, all of the same
architecture (float32 [512] -> [512] through a hidden layer of 7168: 29 MiB of weights) and, to spare the
disk, the same file. Requests (one sample each) pick their model by a Zipf law (exponent 1.1: a few hot, a
long cold tail), the same sequence in both runs, CONCURRENCY=16 in flight on one socket:
  budget   workers.model_memory_mb holds HOLD of them (8.5 x one model's measured memory); starts cold
  all      no budget, every model loaded before the clock starts
A request of the budget run "found its model loaded" when the daemon's log says the model was loaded on the
worker when the request was sent; otherwise it waited for a load. Reported: samples/s, the hit rate, p50/p99
of hits and of waits, loads per minute, the load time (the daemon's stats). Targets, as ratios measured in
the same run:
  M1 hits' p99 <= 1.2 x the all-loaded run's p99
  M2 a load (asked to loaded) under 1 s, at its p50
The runs' loads read the one file from the page cache; beside them, COLD loads (`inferctl load`) of models of
their own files, each dropped from the page cache first, say what a load from the disk costs.
JSON lines are appended to bench/results/many.jsonl.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from bench.common import record, table
from bench.loadgen import percentiles
from inferd import protocol
from inferd.harness import DaemonProcess, local_config, to_toml
from inferd.ipc.sockets import recv_parts, send_parts

WIDTH, HIDDEN = 512, 7168
CONCURRENCY = 16
COLD = 8
ZIPF = 1.1
EVENT = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) .*inferd\.placement: (?:(\S+) \S+ loaded on worker|unloading (\S+) from)")


TOML = to_toml({"inputs": [{"dtype": "float32", "shape": [WIDTH]}], "max_batch_size": 16,
                "warmup_batch_sizes": [1, 16], "load": "on_demand"})


def build(root: Path, count: int) -> Path:
    """`count` model folders under `root`, each a model.toml and a version v1 that links to one file."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))
    weights = root.parent / "weights" / "v1"
    weights.mkdir(parents=True)
    torch.jit.save(torch.jit.script(module.eval()), str(weights / "model.pt"))
    for index in range(count):
        folder = root / f"m{index:02d}"
        folder.mkdir(parents=True)
        (folder / "v1").symlink_to(weights)
        (folder / "model.toml").write_text(TOML)
    return root


def build_cold(root: Path, weights: Path, count: int) -> Path:
    """`count` model folders under `root`, each with its own copy of `weights`, written to the disk and
    dropped from the page cache: a load reads it from the disk."""
    for index in range(count):
        version = root / f"c{index:02d}" / "v1"
        version.mkdir(parents=True)
        (version.parent / "model.toml").write_text(TOML)
        with open(version / "model.pt", "wb") as out:
            out.write(weights.read_bytes())
            out.flush()
            os.fsync(out.fileno())
            os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return root


def traffic(count: int, requests: int) -> list[str]:
    """The models of `requests` requests, drawn by a Zipf law over `count` models (m00 the hottest)."""
    weights = 1.0 / np.arange(1, count + 1) ** ZIPF
    drawn = np.random.default_rng(0).choice(count, size=requests, p=weights / weights.sum())
    return [f"m{index:02d}" for index in drawn]


def drive(endpoint: str, models: list[str], seconds: float) -> list[tuple[float, str, float, str]]:
    """Keep CONCURRENCY requests in flight for `seconds`, models in the order given (cycled); each answered
    request as (wall time sent, model, latency in seconds, status)."""
    x = np.random.default_rng(1).standard_normal((1, WIDTH), dtype=np.float32)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(endpoint)
    order = deque(models)
    sent: dict[int, tuple[float, float, str]] = {}
    done: list[tuple[float, str, float, str]] = []
    ids = iter(range(1 << 62))
    stop_at = time.monotonic() + seconds
    while True:
        if time.monotonic() < stop_at:
            while len(sent) < CONCURRENCY:
                model = order[0]
                order.rotate(-1)
                request_id = next(ids)
                send_parts(socket, protocol.encode_request(request_id, model, [x], timeout_ms=60_000))
                sent[request_id] = (time.time(), time.monotonic(), model)
        elif not sent:
            break
        if not socket.poll(1000):
            continue
        while (frames := recv_parts(socket)) is not None:
            header = protocol.decode_reply_header(frames[0].buffer)
            wall, began, model = sent.pop(header.id)
            done.append((wall, model, time.monotonic() - began, header.status))
    socket.close()
    context.term()
    return done


def loaded_spans(log: str) -> dict[str, list[tuple[float, float]]]:
    """From the daemon's log: each model's spans of wall time during which the worker had it loaded."""
    today = datetime.now().strftime("%Y-%m-%d")
    spans: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    for line in log.splitlines():
        event = EVENT.match(line)
        if event is None:
            continue
        stamp, loaded, unloaded = event.groups()
        when = datetime.strptime(f"{today} {stamp}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
        if loaded:
            since[loaded] = when
        elif unloaded in since:
            spans.setdefault(unloaded, []).append((since.pop(unloaded), when))
    for model, start in since.items():
        spans.setdefault(model, []).append((start, float("inf")))
    return spans


def run(root: Path, workdir: Path, models: list[str], seconds: float, budget_mb: float,
        preload: list[str]) -> tuple[list[tuple[float, str, float, str]], DaemonProcess, dict[str, Any]]:
    """One daemon over `root` with `budget_mb` (0: none), `preload` loaded first; the requests it answered,
    the daemon (stopped), and its stats at the end."""
    workdir.mkdir(parents=True)
    config = local_config(workdir, {}, queue={"max_size": 4096, "default_timeout_ms": 60_000},
                          workers={"devices": ["cpu"], "streams": 2, "shm_mb": 64, "model_memory_mb": budget_mb})
    config["server"]["model_root"] = str(root)
    daemon = DaemonProcess(workdir, config).start()
    try:
        for model in preload:
            daemon.call("load", timeout=120, model=model)
        done = drive(daemon.endpoint, models, seconds) if models else []
        stats = daemon.call("stats")
    finally:
        daemon.stop()
    return done, daemon, stats


def cold_loads(root: Path, workdir: Path) -> list[float]:
    """Each model of `root` loaded by `inferctl load`, one after another: the milliseconds each took."""
    workdir.mkdir(parents=True)
    config = local_config(workdir, {}, workers={"devices": ["cpu"], "streams": 2, "shm_mb": 64})
    config["server"]["model_root"] = str(root)
    daemon = DaemonProcess(workdir, config).start()
    try:
        return [daemon.call("load", timeout=120, model=folder.name)["load_s"] * 1000
                for folder in sorted(root.iterdir())]
    finally:
        daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="of each run")
    parser.add_argument("--models", type=int, default=40)
    parser.add_argument("--hold", type=int, default=8, help="models the budget holds")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-many-"))
    root = build(workdir / "models", args.models)
    names = sorted(path.name for path in root.iterdir())
    models = traffic(args.models, 200_000)
    # One model's memory, as the worker measures it, sizes the budget.
    _, _, stats = run(root, workdir / "size", [], 0.1, 0, [names[0]])
    size = stats["workers"][0]["model_memory_bytes"]
    budget_mb = (args.hold + 0.5) * size / 2**20
    budget, daemon, budget_stats = run(root, workdir / "budget", models, args.seconds, budget_mb, [])
    spans = loaded_spans(daemon.log())
    everything, _, _ = run(root, workdir / "all", models, args.seconds, 0, names)
    cold_root = build_cold(workdir / "cold", root.parent / "weights" / "v1" / "model.pt", COLD)
    cold_ms = cold_loads(cold_root, workdir / "cold-daemon")

    def found_loaded(wall: float, model: str) -> bool:
        return any(start <= wall < end for start, end in spans.get(model, ()))

    ok = [(wall, model, latency) for wall, model, latency, status in budget if status == protocol.OK]
    hits = [latency for wall, model, latency in ok if found_loaded(wall, model)]
    waits = [latency for wall, model, latency in ok if not found_loaded(wall, model)]
    loads = sum(entry["loading"]["loads"] for entry in budget_stats["models"].values())
    load_ms = [entry["loading"]["load_ms"] for entry in budget_stats["models"].values() if entry["loading"]["loads"]]
    rows = [
        {"run": "budget", "models": args.models, "hold": args.hold, "model_bytes": size,
         "budget_mb": round(budget_mb, 1), "seconds": args.seconds,
         "samples_per_s": round(len(ok) / args.seconds, 1), "hit_rate": round(len(hits) / len(ok), 4),
         "hits_ms": percentiles(hits), "waits_ms": percentiles(waits), "loads_per_minute": round(loads * 60 /
                                                                                               args.seconds, 1),
         "load_ms_p50": round(float(np.median([entry["p50"] for entry in load_ms])), 1),
         "load_ms_max": max(entry["max"] for entry in load_ms),
         "statuses": {status: sum(1 for *_, s in budget if s == status) for status in {s for *_, s in budget}},
         "peak_models_held": max(len(entry["models"]) for entry in budget_stats["workers"])},
        {"run": "all", "models": args.models, "seconds": args.seconds,
         "samples_per_s": round(sum(1 for *_, s in everything if s == protocol.OK) / args.seconds, 1),
         "hits_ms": percentiles([latency for _, _, latency, status in everything if status == protocol.OK])},
        {"run": "cold", "models": COLD, "load_ms_p50": round(float(np.median(cold_ms)), 1),
         "load_ms_max": round(max(cold_ms), 1)},
    ]
    record("many", rows)
    print()
    print(render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """The table, and the targets as ratios measured in the same run."""
    budget, everything, cold = rows
    lines = [
        [f"budget (holds {budget['hold']} of {budget['models']})", budget["samples_per_s"],
         budget["hit_rate"], budget["hits_ms"]["p50"], budget["hits_ms"]["p99"], budget["waits_ms"]["p50"],
         budget["waits_ms"]["p99"], budget["loads_per_minute"], budget["load_ms_p50"]],
        [f"all {everything['models']} loaded", everything["samples_per_s"], 1.0, everything["hits_ms"]["p50"],
         everything["hits_ms"]["p99"], "-", "-", 0, "-"],
        [f"cold: {cold['models']} loads from the disk", "-", "-", "-", "-", "-", "-", "-", cold["load_ms_p50"]],
    ]
    m1 = budget["hits_ms"]["p99"] / everything["hits_ms"]["p99"]
    return table(["run", "samples/s", "hit rate", "hits p50 ms", "hits p99 ms", "waits p50 ms", "waits p99 ms",
                  "loads/min", "load p50 ms"], lines) + (
        f"\n\nM1 hits' p99 / all-loaded p99 = {m1:.2f} (target <= 1.2): {'met' if m1 <= 1.2 else 'MISSED'}"
        f"\nM2 load p50 = {budget['load_ms_p50']:.0f} ms (target < 1000): "
        f"{'met' if budget['load_ms_p50'] < 1000 else 'MISSED'}; from the disk {cold['load_ms_p50']:.0f} ms "
        f"(at the most {cold['load_ms_max']:.0f})")


if __name__ == "__main__":
    raise SystemExit(main())
