"""The GPU benchmark: a ResNet-50-shaped model, fp16, channels_last, inferd against in-process on one GPU.

    bench/gpu.sh [--seconds 8] [--parts streams,formats,graphs]

streams: the TorchScript model in-process (batch-1 latency, samples/s at batch
  1..64) and through one worker on cuda:0 with streams 1, 2 and 4, at
  concurrency 1 and 64.
formats: the same weights as TorchScript, a torch.export program, that program
  with compile = "inductor", and an AOTInductor package compiled for the GPU,
  each in-process and through inferd (streams 2) at concurrency 1 and 64, with
  the export and compile times and each load line.
graphs: the ResNet and the benchmark mlp with batch_buckets [1, 8, 32], served
  without and with cuda_graphs at concurrency 1, 8 and 32.
Prints JSON lines (appended to bench/results/gpu.jsonl) and a table per part.
None of it has run on a GPU yet: no GPU was lent to the work so far.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import models
from bench.common import record, table
from bench.formats import format_rows, in_process, served

SHAPE = (3, 224, 224)
DEVICE = "cuda:0"
GRAPH_BUCKETS = [1, 8, 32]


class Bottleneck(torch.nn.Module):
    def __init__(self, channels_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels_in, width, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
            torch.nn.Conv2d(width, width, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
            torch.nn.Conv2d(width, out, 1, bias=False), torch.nn.BatchNorm2d(out),
        )
        self.shortcut = (
            torch.nn.Identity() if stride == 1 and channels_in == out
            else torch.nn.Sequential(torch.nn.Conv2d(channels_in, out, 1, stride, bias=False),
                                     torch.nn.BatchNorm2d(out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50Shaped(torch.nn.Module):
    """ResNet-50's layout (bottlenecks 3, 4, 6, 3), 1000 classes, channels_last inside."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
                                         torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)]
        channels = 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for index in range(blocks):
                layers.append(Bottleneck(channels, width, stride if index == 0 else 1))
                channels = width * 4
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(channels, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def build(repo: Path) -> dict[str, float]:
    """The ResNet in each format from the same weights (repo/resnet/VERSION for torchscript, exported,
    aoti), and the benchmark mlp as TorchScript (repo/mlp/v1); the seconds exporting and compiling took."""
    torch.manual_seed(0)
    model = ResNet50Shaped().eval().half().to(memory_format=torch.channels_last).to(DEVICE)
    folder = repo / "resnet"
    for version in ("torchscript", "exported", "aoti"):
        (folder / version).mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(model), str(folder / "torchscript" / "model.pt"))
    example = (torch.randn(2, *SHAPE, device=DEVICE, dtype=torch.float16),)
    started = time.perf_counter()
    program = torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))
    exported = time.perf_counter()
    torch.export.save(program, str(folder / "exported" / "model.pt2"))
    torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "aoti" / "model.pt2"))
    compiled = time.perf_counter()
    models.save(models.mlp(), repo, "mlp", "v1")
    return {"export_s": round(exported - started, 2), "aoti_compile_s": round(compiled - exported, 2)}


def streams_part(repo: Path, workdir: Path, seconds: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for streams in (1, 2, 4):
        result = served(workdir, repo, "resnet", "torchscript", SHAPE, 64, seconds, streams=streams, device=DEVICE,
                        dtype="float16", label=f"-streams{streams}")
        rows.append({"part": "streams", **result})
    return rows


def formats_part(repo: Path, workdir: Path, seconds: float, made: dict[str, float]) -> list[dict[str, Any]]:
    return [{"part": "formats", **row}
            for row in format_rows(workdir, repo, "resnet", SHAPE, 64, seconds, made, DEVICE, "float16")]


def graphs_part(repo: Path, workdir: Path, seconds: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, version, shape, dtype in (("resnet", "torchscript", SHAPE, "float16"),
                                        ("mlp", "v1", models.MLP_SHAPE, "float32")):
        for graphs in (False, True):
            settings = {"batch_buckets": GRAPH_BUCKETS, "cuda_graphs": graphs, "warmup_batch_sizes": GRAPH_BUCKETS}
            result = served(workdir, repo, name, version, shape, max(GRAPH_BUCKETS), seconds, device=DEVICE,
                            dtype=dtype, settings=settings, concurrencies=tuple(GRAPH_BUCKETS),
                            label=f"-graphs{int(graphs)}")
            rows.append({"part": "graphs", "model": name, "cuda_graphs": graphs, **result})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """A table per part that ran."""
    out = []
    streams = [r for r in rows if r["part"] == "streams"]
    if streams:
        out.append(table(["streams", "C", "samples/s", "p50 ms", "p99 ms", "mean batch"],
                         [[r["streams"], c, r[f"c{c}"]["samples_per_s"], r[f"c{c}"]["latency_ms"]["p50"],
                           r[f"c{c}"]["latency_ms"]["p99"], r[f"c{c}"]["mean_batch"]]
                          for r in streams for c in (1, 64)]))
    formats = [r for r in rows if r["part"] == "formats"]
    if formats:
        out.append(table(["format", "in-process b1 p50 ms", "in-process best/s", "inferd C=1 p50 ms",
                          "inferd C=64 /s", "C=64 p99 ms", "worker CPU us/sample"],
                         [[r["format"], r["in_process"]["batch1_latency_ms"]["p50"],
                           r["in_process"]["best_samples_per_s"],
                           r["inferd"]["c1"]["latency_ms"]["p50"], r["inferd"]["c64"]["samples_per_s"],
                           r["inferd"]["c64"]["latency_ms"]["p99"], r["inferd"]["c64"]["worker_cpu_us_per_sample"]]
                          for r in formats]))
        out.append("; ".join(f"export {r['export_s']} s, AOTInductor compile {r['aoti_compile_s']} s"
                             for r in formats if "aoti_compile_s" in r))
    graphs = [r for r in rows if r["part"] == "graphs"]
    if graphs:
        out.append(table(["model", "cuda_graphs", "C", "samples/s", "p50 ms", "p99 ms", "mean batch"],
                         [[r["model"], r["cuda_graphs"], c, r[f"c{c}"]["samples_per_s"],
                           r[f"c{c}"]["latency_ms"]["p50"], r[f"c{c}"]["latency_ms"]["p99"],
                           r[f"c{c}"]["mean_batch"]] for r in graphs for c in GRAPH_BUCKETS]))
    return "\n\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--parts", default="streams,formats,graphs")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available():
        print("no CUDA GPU here; bench/gpu.py needs one", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="inferd-gpubench-"))
    repo = workdir / "repo"
    made = build(repo)
    rows: list[dict[str, Any]] = [{"part": "reference", "device": torch.cuda.get_device_name(0), **made,
                                   "in_process": in_process(repo / "resnet" / "torchscript" / "model.pt", SHAPE, 64,
                                                            2.0, DEVICE, "float16")}]
    if "streams" in parts:
        rows += streams_part(repo, workdir, args.seconds)
    if "formats" in parts:
        rows += formats_part(repo, workdir, args.seconds, made)
    if "graphs" in parts:
        rows += graphs_part(repo, workdir, args.seconds)
    record("gpu", rows)
    reference = rows[0]["in_process"]
    print(f"\nin-process on {rows[0]['device']}: batch-1 p50 {reference['batch1_latency_ms']['p50']} ms, "
          f"best {reference['best_samples_per_s']} samples/s ({reference['samples_per_s']})\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
