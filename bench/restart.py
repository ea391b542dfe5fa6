"""How soon a crashed worker is replaced, beside what a fresh interpreter's import of torch costs here.

    python -m bench.restart [--rounds 5]

Each round starts a daemon serving the demo's mlp (a torch.export program) on one CPU worker, then SIGKILLs
the worker and times the replacement, from the kill to the worker `ready` in `inferctl status` (the first
restart, which has no backoff). Workers are forked from a fork server that has imported torch, so the
replacement does not import it again; the reference, measured in the same run, is `python -c "import torch"`
in a fresh interpreter: what a spawned worker would add.
JSON lines are appended to bench/results/restart.jsonl.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import record, start_daemon, table
from inferd import demo


def replacement_s(workdir: Path, repository: Path) -> tuple[float, float]:
    """Start a daemon in `workdir`; the seconds its start took and the seconds its killed worker took to be
    replaced."""
    model = {"repository": str(repository / "mlp"), "inputs": [{"dtype": "float32", "shape": [demo.IN_FEATURES]}],
             "max_batch_size": 32}
    began = time.monotonic()
    daemon = start_daemon(workdir, {"mlp": model})
    started = time.monotonic() - began
    try:
        worker = daemon.status()["workers"][0]
        began = time.monotonic()
        os.kill(worker["pid"], signal.SIGKILL)
        while not ((now := daemon.status()["workers"][0])["restarts"] == 1 and now["state"] == "ready"):
            time.sleep(0.005)
        return started, time.monotonic() - began
    finally:
        daemon.stop()


def import_torch_s() -> float:
    """Wall seconds of a fresh interpreter that imports torch and exits."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferd-restart-") as scratch:
        root = Path(scratch)
        demo.build_repository(root / "repo")
        starts, replacements, imports = [], [], []
        for round_ in range(args.rounds):
            started, replaced = replacement_s(root / f"daemon{round_}", root / "repo")
            starts.append(started)
            replacements.append(replaced)
            imports.append(import_torch_s())
    row = {"bench": "restart", "rounds": args.rounds, "start_s": statistics.median(starts),
           "replacement_s": statistics.median(replacements), "import_torch_s": statistics.median(imports)}
    record("restart", [row])
    print(table(["daemon start (s)", "worker replaced (s)", "fresh `import torch` (s)"],
                [[f"{row['start_s']:.2f}", f"{row['replacement_s']:.2f}", f"{row['import_torch_s']:.2f}"]]))


if __name__ == "__main__":
    main()
