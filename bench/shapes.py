"""Inputs of any size batched three ways, measured in one run: a small transformer encoder served with token
sequences whose lengths are mostly short with a long tail to 512.

    python -m bench.shapes [--seconds 5]

The model (an embedding, two encoder layers of width 64, masked mean pooling: its answer for a request does
not depend on the padding) is served by one daemon (one CPU worker, two executors) as three models of the same
weights: "exact" (requests batch only with requests of the same length), "padmax" (padded to max_shape, 512:
shape_buckets = [512]) and "buckets" (shape_buckets = [16, 32, 64, 128, 256, 512]). Each is driven at
concurrency 1 and 64 with the same 512 requests, lengths drawn from a log-normal distribution (median 24).
Reported: samples/s, p50 and p99 in ms, and the padding share (elements of padding over elements the requests
brought, from the daemon's stats). Targets, as ratios measured in the same run, at C=64:
  S1 buckets' samples/s >= 1.5 x padmax's, with p99 no worse
  S2 buckets' samples/s >= 2 x exact's
JSON lines are appended to bench/results/shapes.jsonl.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import loadgen
from bench.common import record, start_daemon, table

MAX_LENGTH = 512
VOCAB = 1000
REQUESTS = 512
MAX_BATCH = 32
BUCKETS = [16, 32, 64, 128, 256, 512]


class Encoder(torch.nn.Module):
    """Token ids and their attention mask (int64 [L] each) -> a 64-wide embedding of the sequence, the mean of
    its tokens' states where the mask is 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states = self.layers(self.embed(ids), src_key_padding_mask=mask == 0)
        weights = mask.unsqueeze(-1).to(states.dtype)
        return (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def lengths(count: int, seed: int = 0) -> list[int]:
    """Sequence lengths, most short and a long tail to MAX_LENGTH: log-normal, median 24."""
    drawn = np.random.default_rng(seed).lognormal(np.log(24), 1.0, count)
    return [int(n) for n in np.clip(np.round(drawn), 1, MAX_LENGTH)]


def requests(count: int) -> list[list[np.ndarray]]:
    """Each request's ids and mask, one sample each."""
    rng = np.random.default_rng(1)
    made = []
    for length in lengths(count):
        made.append([rng.integers(1, VOCAB, (1, length), dtype=np.int64), np.ones((1, length), dtype=np.int64)])
    return made


def model_configs(repo: Path) -> dict[str, dict[str, Any]]:
    """The three ways, on the same weights."""
    inputs = [{"dtype": "int64", "shape": [-1], "max_shape": [MAX_LENGTH], "name": name} for name in ("ids", "mask")]
    padded = [{**spec, "pad_value": 0} for spec in inputs]
    base = {"repository": str(repo / "encoder"), "max_batch_size": MAX_BATCH, "warmup_batch_sizes": [1]}
    return {
        "exact": {**base, "inputs": inputs},
        "padmax": {**base, "inputs": padded, "shape_buckets": [MAX_LENGTH]},
        "buckets": {**base, "inputs": padded, "shape_buckets": BUCKETS},
    }


def padding(daemon: Any, model: str) -> tuple[int, int]:
    """Elements the requests brought, and elements of padding, since the daemon started."""
    shapes = daemon.call("stats")["models"][model]["shapes"].values()
    return sum(s["elements"] for s in shapes), sum(s["padding_elements"] for s in shapes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each load generator run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="inferd-shapes-"))
    repo = workdir / "repo"
    (repo / "encoder" / "v1").mkdir(parents=True)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(Encoder().eval()), str(repo / "encoder" / "v1" / "model.pt"))
    given = requests(REQUESTS)
    daemon = start_daemon(workdir / "daemon", model_configs(repo))
    rows: list[dict[str, Any]] = []
    try:
        for way in ("exact", "padmax", "buckets"):
            for concurrency in (1, 64):
                before = padding(daemon, way)
                result = loadgen.run(daemon.endpoint, way, (MAX_LENGTH,), "int64", concurrency, args.seconds,
                                     warmup=1.0, timeout_ms=60_000, given=given)
                after = padding(daemon, way)
                real, padded = (b - a for a, b in zip(before, after))
                rows.append({"way": way, "concurrency": concurrency, "samples_per_s": result["samples_per_s"],
                             "latency_ms": result["latency_ms"], "statuses": result["statuses"],
                             "padding_share": round(padded / real, 3) if real else 0.0})
    finally:
        daemon.stop()
    record("shapes", rows)
    print()
    print(render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """The table, and the targets as ratios at C=64."""
    by = {(r["way"], r["concurrency"]): r for r in rows}
    lines = [[r["way"], r["concurrency"], r["samples_per_s"], r["latency_ms"]["p50"], r["latency_ms"]["p99"],
              r["padding_share"]] for r in rows]
    buckets, padmax, exact = by[("buckets", 64)], by[("padmax", 64)], by[("exact", 64)]
    s1 = buckets["samples_per_s"] / padmax["samples_per_s"]
    s1_met = s1 >= 1.5 and buckets["latency_ms"]["p99"] <= padmax["latency_ms"]["p99"]
    s2 = buckets["samples_per_s"] / exact["samples_per_s"]
    return table(["batching", "C", "samples/s", "p50 ms", "p99 ms", "padding share"], lines) + (
        f"\nS1 buckets at C=64: {s1:.2f} x padmax's samples/s, p99 {buckets['latency_ms']['p99']} ms against "
        f"{padmax['latency_ms']['p99']} ms ({'met' if s1_met else 'missed'}, target 1.5 x with p99 no worse)"
        f"\nS2 buckets at C=64: {s2:.2f} x exact's samples/s ({'met' if s2 >= 2 else 'missed'}, target 2 x)")


if __name__ == "__main__":
    raise SystemExit(main())
