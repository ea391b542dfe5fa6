"""Triton's perf_analyzer against inferd, beside inferd's own load generator, in one run.

    python -m bench.perf_analyzer [--seconds 5]

A user comparing inferd with Triton runs perf_analyzer against both. This runs it (the binary
tests/third_party.py installs beside the venv) against a daemon serving the benchmark mlp over
HTTP and gRPC at concurrency 1, 8 and 64, each run right after bench/oip_loadgen.py's closed loop
at the same concurrency and for as long, and gives the ratio of their throughputs (the goal:
within 15 %), then perf_analyzer again with `--shared-memory system`. JSON lines are appended to
bench/results/perf_analyzer.jsonl; the table follows, with each tool's own CPU per request: on a
2-core machine the client shares the cores with the daemon, so a costlier client leaves it less.
"""

from __future__ import annotations

import argparse
import csv
import resource
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import models
from bench.common import ROOT, record, run_oip_loadgen, start_daemon
from bench.run import model_configs
from inferd.harness import DaemonProcess, free_port

PERF_ANALYZER = ROOT / ".venv" / "tools" / "perf_analyzer"  # where tests/third_party.py puts it
CONCURRENCIES = (1, 8, 64)


def _answered(daemon: DaemonProcess) -> int:
    return sum(daemon.call("stats")["models"]["mlp"]["requests"].values())


def perf_analyzer(daemon: DaemonProcess, protocol: str, address: str, concurrency: int, seconds: float,
                  shared_memory: str, report: Path) -> dict[str, Any]:
    """One perf_analyzer measurement: its throughput, latency, the server's breakdown (us), and its own CPU
    per request the daemon answered meanwhile (its warm-up and windows alike).

    perf_analyzer averages its last three windows once they agree within --stability-percentage; on a
    shared 2-core machine they rarely agree within its default 10 %, so windows of a third of `seconds`
    each are taken once three agree within 100 %, the same span as the load generator's."""
    answered = _answered(daemon)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([str(PERF_ANALYZER), "-m", "mlp", "-u", address, "-i", protocol, "--concurrency-range",
                           str(concurrency), "--measurement-interval", str(int(seconds * 1000 / 3)),
                           "--stability-percentage", "100", "--max-trials", "10", "--shared-memory", shared_memory,
                           "-f", str(report)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"perf_analyzer failed ({protocol}, C={concurrency}):\n{done.stdout[-2000:]}{done.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    [row] = csv.DictReader(report.open())
    return {"samples_per_s": float(row["Inferences/Second"]),
            "cpu_us_per_request": round(cpu_s / max(1, _answered(daemon) - answered) * 1e6, 1),
            "p50_ms": float(row["p50 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000,
            "server_us": {key: float(row[f"Server {name}"]) for key, name in (
                ("queue", "Queue"), ("compute_input", "Compute Input"), ("compute_infer", "Compute Infer"),
                ("compute_output", "Compute Output"))}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each measurement")
    args = parser.parse_args()
    if not PERF_ANALYZER.exists():
        parser.error(f"{PERF_ANALYZER} is missing: `make test` installs it (python tests/third_party.py install .venv)")
    workdir = Path(tempfile.mkdtemp(prefix="inferd-pa-"))
    models.build(workdir / "repo")
    front_ends = {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"}
    daemon = start_daemon(workdir / "daemon", {"mlp": model_configs(workdir / "repo")["mlp"]},
                          server={**front_ends, "allow_client_shm": True, "client_shm_prefix": "",
                                  "client_shm_scope": "server"},
                          workers={"streams": 2, "devices": ["cpu"], "shm_mb": 64})
    rows = []
    try:
        for protocol, address in front_ends.items():
            for concurrency in CONCURRENCIES:
                ours = run_oip_loadgen(protocol, address, "mlp", models.MLP_SHAPE, concurrency, args.seconds)
                theirs = perf_analyzer(daemon, protocol, address, concurrency, args.seconds, "none",
                                       workdir / "pa.csv")
                shared = perf_analyzer(daemon, protocol, address, concurrency, args.seconds, "system",
                                       workdir / "pa.csv")
                rows.append({"protocol": protocol, "concurrency": concurrency,
                             "oip_loadgen_samples_per_s": ours["samples_per_s"],
                             "oip_loadgen_p50_ms": ours["latency_ms"]["p50"],
                             "oip_loadgen_cpu_us_per_request": ours["cpu_us_per_request"], "perf_analyzer": theirs,
                             "perf_analyzer_shared_memory": shared,
                             "ratio": round(theirs["samples_per_s"] / ours["samples_per_s"], 3)})
    finally:
        daemon.stop()
    record("perf_analyzer", rows)
    print()
    print(render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """The table: each protocol and concurrency, both tools' samples/s and their ratio."""
    lines = [f"{'case':<12} {'oip_loadgen/s':>14} {'perf_analyzer/s':>16} {'ratio':>6} {'shm/s':>9} "
             f"{'server us':>10} {'client CPU us: ours':>20} {'theirs':>7}  within 15 %"]
    for row in rows:
        theirs = row["perf_analyzer"]
        server = sum(theirs["server_us"].values())
        ok = abs(row["ratio"] - 1) <= 0.15
        case = f"{row['protocol']} C={row['concurrency']}"
        lines.append(f"{case:<12} {row['oip_loadgen_samples_per_s']:>14.0f} "
                     f"{theirs['samples_per_s']:>16.0f} {row['ratio']:>6.2f} "
                     f"{row['perf_analyzer_shared_memory']['samples_per_s']:>9.0f} {server:>10.0f} "
                     f"{row['oip_loadgen_cpu_us_per_request']:>20.0f} {theirs['cpu_us_per_request']:>7.0f}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
