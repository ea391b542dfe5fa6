"""ZeroMQ groups against one request per message: the benchmark mlp at C=64 through one CPU worker of one
executor, beside the model in-process at batch 32, measured in one run, round after round.

    python -m bench.wire_groups [--rounds 3] [--seconds 5]

Each round measures the model in-process (batch 32, one thread, as the worker runs it), then the daemon
driven by bench/loadgen.py with one request per message and with groups (what is sent at once goes as one
message, as the Python client sends it), in an order that turns from round to round. The table gives each
way's medians over the rounds: samples/s as a ratio to the in-process model of its round, the daemon's CPU
per request (supervisor and worker) and the load generator's own. JSON lines are appended to
bench/results/wire_groups.jsonl.

Targets (issue 53, on a 2-core machine): one request per message >= 0.5 x the in-process model; groups
>= 0.7 x; the daemon's CPU per request <= 70 us.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import psutil

from bench import models
from bench.common import cpu_seconds, record, run_loadgen, start_daemon, table
from bench.run import in_process

WAYS = ("one per message", "groups")


def measure(daemon: Any, processes: list[psutil.Process], group: bool, seconds: float) -> dict[str, Any]:
    """One load generator run at C=64, and what it cost the daemon's processes per request."""
    before = cpu_seconds(processes)
    answered_before = sum(daemon.call("stats")["models"]["mlp"]["requests"].values())
    result = run_loadgen(daemon.endpoint, "mlp", models.MLP_SHAPE, 64, seconds, group=group)
    supervisor_s, worker_s = (after - was for after, was in zip(cpu_seconds(processes), before))
    requests = max(1, sum(daemon.call("stats")["models"]["mlp"]["requests"].values()) - answered_before)
    return {**result, "supervisor_cpu_us_per_request": round(supervisor_s / requests * 1e6, 1),
            "worker_cpu_us_per_request": round(worker_s / requests * 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    parser.add_argument("--spin-us", type=int, help="the daemon's server.spin_us (default: its default)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-bench-groups-"))
    repo = workdir / "repo"
    models.build(repo)
    mlp = {"repository": str(repo / "mlp"), "inputs": [{"dtype": "float32", "shape": list(models.MLP_SHAPE)}],
           "max_batch_size": 32, "warmup_batch_sizes": [1, 32]}
    server = {} if args.spin_us is None else {"spin_us": args.spin_us}
    daemon = start_daemon(workdir / "daemon", {"mlp": mlp}, workers={"streams": 1, "devices": ["cpu"]},
                          server=server)
    rows: list[dict[str, Any]] = []
    try:
        worker = daemon.status()["workers"][0]["pid"]
        processes = [psutil.Process(daemon.process.pid), psutil.Process(worker)]
        for round_number in range(args.rounds):
            reference = in_process(repo, "mlp", models.MLP_SHAPE, 1.0)["samples_per_s"]["32"]
            rows.append({"kind": "reference", "round": round_number, "in_process_b32_samples_per_s": reference})
            order = WAYS if round_number % 2 == 0 else WAYS[::-1]
            for way in order:
                result = measure(daemon, processes, way == "groups", args.seconds)
                rows.append({"kind": "inferd", "round": round_number, "way": way,
                             "ratio_to_in_process": round(result["samples_per_s"] / reference, 3), **result})
    finally:
        daemon.stop()
    record("wire_groups", rows)
    print()
    print(render([r for r in rows if r["kind"] == "inferd"]))
    return 0


def render(runs: list[dict[str, Any]]) -> str:
    """Each way's medians over the rounds, and the targets."""
    lines = []
    for way, wanted in zip(WAYS, (0.5, 0.7)):
        mine = [r for r in runs if r["way"] == way]

        def median(key: str, of: list[dict[str, Any]] = mine) -> float:
            return round(statistics.median(r[key] for r in of), 3)

        ratio = median("ratio_to_in_process")
        daemon_us = round(median("supervisor_cpu_us_per_request") + median("worker_cpu_us_per_request"), 1)
        verdict = "met" if ratio >= wanted else "MISSED"
        lines.append([way, median("samples_per_s"), f"{ratio:.2f} (>= {wanted:g}: {verdict})",
                      median("supervisor_cpu_us_per_request"), median("worker_cpu_us_per_request"),
                      f"{daemon_us} (<= 70: {'met' if daemon_us <= 70 else 'MISSED'})",
                      median("cpu_us_per_request"), statistics.median(r["latency_ms"]["p50"] for r in mine)])
    return table(["way", "samples/s", "x in-process b32", "supervisor us/request", "worker us/request",
                  "daemon us/request", "load generator us/request", "p50 ms"], lines)


if __name__ == "__main__":
    raise SystemExit(main())
