"""What the supervisor's control commands cost with many models configured: each one holds its loop.

    python -m bench.control [--models 1000] [--times 5]

One daemon (one CPU worker) serves the benchmark MLP beside MODELS on-demand models of a model_root, never
loaded. Each command is asked TIMES times over the control socket, one after another; the median round
trip is reported in milliseconds, beside `health` (the round trip itself). `models` of one model is what
the HTTP and gRPC gateways ask once a second per model under traffic; the others are operators' commands.
JSON lines are appended to bench/results/control.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import models
from bench.common import record, start_daemon, table
from bench.run import model_configs
from inferd.harness import to_toml

COMMANDS: list[tuple[str, dict[str, Any]]] = [("health", {}), ("models", {"model": "m0"}), ("models", {}),
                                              ("stats", {}), ("status", {})]


def model_root(root: Path, repo: Path, count: int) -> Path:
    """`count` on-demand model folders under `root`, each a model.toml and a version v1 linked to the mlp's."""
    toml = to_toml({"inputs": [{"dtype": "float32", "shape": list(models.MLP_SHAPE)}], "max_batch_size": 32,
                    "load": "on_demand"})
    for index in range(count):
        folder = root / f"m{index}"
        folder.mkdir(parents=True)
        (folder / "v1").symlink_to(repo / "mlp" / "v1")
        (folder / "model.toml").write_text(toml)
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--times", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-control-"))
    models.build(workdir / "repo")
    root = model_root(workdir / "models", workdir / "repo", args.models)
    daemon = start_daemon(workdir / "daemon", {"mlp": model_configs(workdir / "repo")["mlp"]},
                          server={"model_root": str(root)}, workers={"devices": ["cpu"]})
    rows = []
    try:
        for command, arguments in COMMANDS:
            times = []
            for _ in range(args.times):
                began = time.perf_counter()
                daemon.call(command, **arguments)
                times.append(time.perf_counter() - began)
            rows.append({"models": args.models + 1, "command": command, "arguments": arguments,
                         "median_ms": round(statistics.median(times) * 1000, 2)})
    finally:
        daemon.stop()
    record("control", rows)
    print()
    print(table(["command", "median ms"],
                [[" ".join([row["command"], *(f"{k}={v}" for k, v in row["arguments"].items())]), row["median_ms"]]
                 for row in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
