"""The fleet simulation's command line: one JSON line per scenario, then a table.

    python -m deploy.sim.run [--seed N] [--nodes 16,64,256] [--hours 24] [--step 60] [--jobs N]
    python -m deploy.sim.run --sweep [--weights 0,10,25,50,100] [--spread 100]

Without --sweep: for each node count and GPU-sharing mode, the default
scheduler alone and with inferd-fleet. With --sweep: inferd-fleet with each
podAffinity weight (the spread weight as the manifest has it, or --spread),
for choosing the manifest's weight. The preferred terms' weights come from
deploy/kubernetes/deployment.yaml (0 for a term it lacks). --threshold changes the
fragmentation rule's threshold, to see what the rule does where it fires.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from deploy.sim.engine import STEP_S, Scenario, simulate
from deploy.sim.fleet import MODES
from deploy.sim.scheduler import manifest_weights
from inferd.fleet.decisions import Policy

SWEEP_WEIGHTS = (0, 10, 25, 50, 100)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios the arguments ask for, in the order they are printed."""
    weights = manifest_weights()
    if args.spread is not None:
        weights = dataclasses.replace(weights, spread=args.spread)
    base = {"seed": args.seed, "hours": args.hours, "step_s": args.step,
            "policy": Policy() if args.threshold is None else Policy(threshold=args.threshold)}
    if args.sweep:
        return [Scenario(n, mode, True, weights=dataclasses.replace(weights, affinity=w), **base)
                for n in args.nodes for mode in MODES for w in args.weights]
    return [Scenario(n, mode, controller, weights=weights, **base)
            for n in args.nodes for mode in MODES for controller in (False, True)]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Plain columns, numbers right-aligned."""
    cells = [[str(h) for h in header]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] in "-." else c.ljust(w)
                               for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def scenario_table(results: list[dict[str, Any]]) -> str:
    """The default run's table."""
    header = ("nodes", "mode", "scenario", "stranded GiB", "peak GiB", "% fleet", "idle held %", "loads/rollout",
              "pods started", "rollout h", "SLO over", "SLO %", "moved", "refused", "trimmed", "pending pod-min",
              "OOM pod-min")
    return table(header, [(r["nodes"], r["mode"], r["scenario"], r["stranded_mean_gib"], r["stranded_peak_gib"],
                           r["stranded_pct"], r["idle_requested_pct"], r["rollout_loads"], r["rollout_starts"],
                           r["rollout_hours"],
                           r["slo_over"], r["slo_over_pct"], r["pods_moved"], r["evictions_refused"],
                           r["pods_trimmed"], r["pending_pod_min"], r["oom_pod_min"]) for r in results])


def sweep_table(results: list[dict[str, Any]]) -> str:
    """The sweep's table: what each podAffinity weight costs in loads and in spread."""
    header = ("nodes", "mode", "affinity", "spread", "loads/rollout", "pods started", "largest share %", "SLO %",
              "moved")
    return table(header, [(r["nodes"], r["mode"], r["weights"]["affinity"], r["weights"]["spread"],
                           r["rollout_loads"], r["rollout_starts"], r["spread_pct"], r["slo_over_pct"],
                           r["pods_moved"]) for r in results])


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; print each one's JSON line as it finishes, in order, then the table."""
    parser = argparse.ArgumentParser(prog="python -m deploy.sim.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=_ints, default=[16, 64, 256], help="node counts, comma-separated")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--step", type=float, default=STEP_S, help="seconds simulated per step")
    parser.add_argument("--sweep", action="store_true", help="inferd-fleet at each podAffinity weight")
    parser.add_argument("--weights", type=_ints, default=list(SWEEP_WEIGHTS), help="the sweep's weights")
    parser.add_argument("--spread", type=int, help="the podAntiAffinity spread weight, instead of the manifest's")
    parser.add_argument("--threshold", type=float, help="the fragmentation rule's threshold (default 0.25)")
    parser.add_argument("--jobs", type=int, default=1, help="scenarios run at once, one process each")
    args = parser.parse_args(argv)
    runs = scenarios(args)
    results = []
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else _Inline() as pool:
        for result in pool.map(simulate, runs):
            print(json.dumps(result), flush=True)
            results.append(result)
    print()
    print(sweep_table(results) if args.sweep else scenario_table(results))
    return 0


class _Inline:
    """The executor interface for --jobs 1: in this process, one after another."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def map(fn: Any, items: Iterable[Any]) -> Iterable[Any]:
        """fn over items, lazily, as Executor.map."""
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())
