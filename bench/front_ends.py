"""The front ends against the ZeroMQ path, as ratios measured in one run, round after round.

    python -m bench.front_ends [--rounds 3] [--seconds 5] [--models mlp,cnn] [--concurrency 1,64]
                               [--protocols http,grpc] [--http-processes 1] [--grpc-processes 1]
                               [--variant NAME=PYTHONPATH ...]

Each round starts one daemon (one CPU worker of 2 streams, the matrix's models) per variant, in an order
that turns from round to round, and drives each case over ZeroMQ (bench/loadgen.py, one request per
message) and then over each front end (bench/oip_loadgen.py), the same closed loop, 5 s after a 2 s
warm-up. A front end's figures are ratios to the ZeroMQ run just before it on the same daemon, so the
machine's drift falls on both; the table gives each ratio's median over the rounds, and each process's CPU
per request (the load generator's own included: what the figures would gain with the client on another
machine). The targets (issue 53): HTTP mlp C=64 at least 0.6 x the ZeroMQ path, gRPC 0.35 x; at C=1 a
p50 at most ZeroMQ's + 0.2 ms.

A variant is a checkout of inferd whose daemon runs with that PYTHONPATH (`--variant before=../before`
beside `--variant after=.`): two versions compared in one run, alternating. Without one, this checkout.
bench/variants/ holds folders to add to a variant's PYTHONPATH that swap a front end's server (Granian for
uvicorn, grpcio's sync server for its asyncio one); each file says how to run it.
JSON lines are appended to bench/results/front_ends.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import models
from bench.common import ROOT, cpu_seconds, record, run_loadgen, run_oip_loadgen, table
from bench.run import model_configs
from inferd.harness import DaemonProcess, free_port, local_config

SHAPES = {"mlp": models.MLP_SHAPE, "cnn": models.CNN_SHAPE}
P50_SLACK_MS = 0.2  # C=1: a front end's p50 at most the ZeroMQ path's plus this
RATIO_TARGET = {"http": 0.6, "grpc": 0.35}  # C=64 samples/s, as a share of the ZeroMQ path's


def start(workdir: Path, repo: Path, env: dict[str, str], http_processes: int, grpc_processes: int) -> DaemonProcess:
    """A daemon of the mlp and the cnn with both front ends, run with `env` (its PYTHONPATH: whose code)."""
    workdir.mkdir(parents=True, exist_ok=True)
    configs = model_configs(repo)
    config = local_config(workdir, {name: configs[name] for name in SHAPES}, queue={"max_size": 4096})
    config["server"].update(http=f"127.0.0.1:{free_port()}", grpc=f"127.0.0.1:{free_port()}",
                            http_processes=http_processes, grpc_processes=grpc_processes)
    config["workers"].update(streams=2, devices=["cpu"])
    return DaemonProcess(workdir, config, env=env).start(timeout=120)


def processes(daemon: DaemonProcess) -> dict[str, list[psutil.Process]]:
    """The daemon's processes by part: supervisor, each protocol's gateways, workers."""
    supervisor = psutil.Process(daemon.process.pid)
    parts: dict[str, list[psutil.Process]] = {"supervisor": [supervisor], "http": [], "grpc": [], "worker": []}
    for child in supervisor.children():
        title = child.cmdline()[0]
        if title.startswith("inferd: gateway"):
            parts["grpc" if "grpc" in title else "http"].append(child)
    parts["worker"] = [psutil.Process(w["pid"]) for w in daemon.status()["workers"]]
    return parts


def parts_cpu_seconds(parts: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """Each part's CPU time so far, its processes together."""
    return {part: sum(cpu_seconds(group)) for part, group in parts.items()}


def measure(daemon: DaemonProcess, protocol: str, model: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """One load generator run against `daemon`, with each part's CPU per request answered."""
    parts = processes(daemon)
    answered = sum(daemon.status()["replies"].values())
    before = parts_cpu_seconds(parts)
    if protocol == "zeromq":
        result = run_loadgen(daemon.endpoint, model, SHAPES[model], concurrency, seconds)
    else:
        address = daemon.config["server"][protocol]  # type: ignore[index]
        result = run_oip_loadgen(protocol, address, model, SHAPES[model], concurrency, seconds)
    after = parts_cpu_seconds(parts)
    requests = max(1, sum(daemon.status()["replies"].values()) - answered)
    cpu = {part: round((after[part] - before[part]) / requests * 1e6, 1) for part in ("supervisor", "worker")}
    cpu["gateway"] = round((after[protocol] - before[protocol]) / requests * 1e6, 1) if protocol != "zeromq" else 0.0
    cpu["loadgen"] = result["cpu_us_per_request"]
    return {"samples_per_s": result["samples_per_s"], "p50_ms": result["latency_ms"]["p50"],
            "p99_ms": result["latency_ms"]["p99"], "statuses": result["statuses"], "cpu_us_per_request": cpu}


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """NAME=PYTHONPATH[,VAR=VALUE...]: a variant's name and its daemon's environment."""
    name, _, rest = spec.partition("=")
    pythonpath, *settings = rest.split(",")
    return name, {"PYTHONPATH": pythonpath, **dict(setting.split("=", 1) for setting in settings)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--http-processes", type=int, default=1)
    parser.add_argument("--grpc-processes", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PYTHONPATH[,VAR=VALUE...]",
                        help="a checkout to measure, and the daemon's environment (repeat to compare); "
                             "default: this checkout")
    args = parser.parse_args()
    variants = [variant(v) for v in args.variant] or [("this", {"PYTHONPATH": str(ROOT)})]
    cases = [(m, int(c)) for m in args.models.split(",") for c in args.concurrency.split(",")]
    protocols = args.protocols.split(",")
    root = Path(tempfile.mkdtemp(prefix="inferd-front-"))
    models.build(root / "repo")
    rows: list[dict[str, Any]] = []
    for round_number in range(args.rounds):
        turn = round_number % len(variants)
        for name, env in variants[turn:] + variants[:turn]:
            daemon = start(root / f"{name}-{round_number}", root / "repo", env, args.http_processes,
                           args.grpc_processes)
            try:
                for model, concurrency in cases:
                    zeromq = measure(daemon, "zeromq", model, concurrency, args.seconds)
                    rows.append({"variant": name, "round": round_number, "protocol": "zeromq", "model": model,
                                 "concurrency": concurrency, **zeromq})
                    for protocol in protocols:
                        result = measure(daemon, protocol, model, concurrency, args.seconds)
                        rows.append({"variant": name, "round": round_number, "protocol": protocol, "model": model,
                                     "concurrency": concurrency, **result,
                                     "ratio": round(result["samples_per_s"] / zeromq["samples_per_s"], 3),
                                     "p50_over_ms": round(result["p50_ms"] - zeromq["p50_ms"], 3)})
            finally:
                daemon.stop()
    settings = {"http_processes": args.http_processes, "grpc_processes": args.grpc_processes,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    record("front_ends", [{**settings, **row} for row in rows])
    print()
    print(render(rows, [name for name, _ in variants], cases, ["zeromq", *protocols]))
    return 0


def render(rows: list[dict[str, Any]], variants: list[str], cases: list[tuple[str, int]],
           protocols: list[str]) -> str:
    """Each variant's, case's and protocol's medians over the rounds."""
    lines = []
    for model, concurrency in cases:
        for protocol in protocols:
            for name in variants:
                runs = [r for r in rows if (r["variant"], r["protocol"], r["model"], r["concurrency"]) ==
                        (name, protocol, model, concurrency)]
                if not runs:
                    continue

                def median(key: str, of: list[dict[str, Any]] = runs) -> float:
                    return round(statistics.median(r[key] for r in of), 3)

                cpu = {part: round(statistics.median(r["cpu_us_per_request"][part] for r in runs), 1)
                       for part in ("supervisor", "gateway", "worker", "loadgen")}
                target = ""
                if protocol != "zeromq" and concurrency == 1:
                    over = median("p50_over_ms")
                    target = f"p50 +{over:.3f} ms ({'met' if over <= P50_SLACK_MS else 'missed'})"
                elif protocol != "zeromq":
                    ratio = median("ratio")
                    wanted = RATIO_TARGET[protocol] if model == "mlp" else None
                    target = f"{ratio:.2f} x" + ("" if wanted is None else
                                                 f" ({'met' if ratio >= wanted else 'missed'}: >= {wanted:g})")
                lines.append([name, protocol, f"{model} C={concurrency}", median("samples_per_s"), median("p50_ms"),
                              median("p99_ms"), cpu["supervisor"], cpu["gateway"], cpu["worker"], cpu["loadgen"],
                              target])
    header = ["variant", "protocol", "case", "samples/s", "p50 ms", "p99 ms", "CPU us/request: supervisor",
              "gateway", "worker", "load generator", "against ZeroMQ (median of rounds)"]
    return table(header, lines)


if __name__ == "__main__":
    raise SystemExit(main())
