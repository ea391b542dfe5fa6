"""The supervisor's own CPU per request, by thread: its loop and ZeroMQ's I/O threads.

    python -m bench.supervisor_cpu [--runs 3] [--seconds 5] [--front-ends] [--idle-models N]

One daemon (one CPU worker, 2 streams) serves the benchmark MLP; the load
generator keeps 64 requests in flight on one connection (with --front-ends, the
HTTP and gRPC gateways run beside it, idle; with --idle-models N, N more models
loaded on demand are configured beside it and never asked for, as a daemon
serving a model per customer has them). Each run prints the
CPU time the supervisor's main thread (the loop) and its ZeroMQ I/O threads
spent per request answered. Narrower than the matrix, and so steadier: it is the
number to compare two versions of the supervisor by, run alternately on each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import psutil

from bench import models
from bench.common import run_loadgen, start_daemon
from bench.run import model_configs
from inferd.harness import free_port


def thread_seconds(process: psutil.Process) -> dict[tuple[int, str], float]:
    """CPU seconds of each thread of `process`, by (thread id, thread name)."""
    seconds = {}
    for thread in process.threads():
        name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
        seconds[(thread.id, name)] = thread.user_time + thread.system_time
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--front-ends", action="store_true",
                        help="with the HTTP and gRPC front ends on (idle), as make bench runs the daemon")
    parser.add_argument("--idle-models", type=int, default=0, metavar="N",
                        help="N more on-demand models configured and never asked for")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inferd-cpu-"))
    models.build(root / "repo")
    sections = {"server": {name: f"127.0.0.1:{free_port()}" for name in ("http", "grpc")}} if args.front_ends else {}
    mlp = model_configs(root / "repo")["mlp"]
    idle = {f"idle{index}": {**mlp, "load": "on_demand"} for index in range(args.idle_models)}
    daemon = start_daemon(root / "daemon", {"mlp": mlp, **idle},
                          workers={"devices": ["cpu"], "streams": 2}, **sections)
    try:
        supervisor = psutil.Process(daemon.process.pid)
        run_loadgen(daemon.endpoint, "mlp", models.MLP_SHAPE, 64, 2.0)  # warm
        for _ in range(args.runs):
            before, answered = thread_seconds(supervisor), sum(daemon.status()["replies"].values())
            result = run_loadgen(daemon.endpoint, "mlp", models.MLP_SHAPE, 64, args.seconds, warmup=0.0)
            after = thread_seconds(supervisor)
            requests = sum(daemon.status()["replies"].values()) - answered
            used = {key: after[key] - before.get(key, 0.0) for key in after}
            loop = sum(s for (tid, _), s in used.items() if tid == supervisor.pid)
            io = sum(s for (_, name), s in used.items() if name.startswith("ZMQbg"))
            print(json.dumps({"samples_per_s": result["samples_per_s"],
                              "loop_us_per_request": round(loop / requests * 1e6, 1),
                              "zmq_io_us_per_request": round(io / requests * 1e6, 1)}), flush=True)
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
