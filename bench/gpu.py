"""The GPU benchmark: a ResNet-50-shaped model, fp16, channels_last, inferd against in-process on one GPU.

    bench/gpu.sh            (or: python -m bench.gpu [--seconds 8])

In-process reference: batch-1 latency and samples/s at batch 1..64 on cuda:0.
inferd: one worker on cuda:0 with streams 1, 2 and 4, at concurrency 1 and 64.
Prints JSON lines (appended to bench/results/gpu.jsonl) and a table; runs in
about five minutes on an H100-class GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import record, run_loadgen, start_daemon, table

SHAPE = (3, 224, 224)


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


def build(root: Path) -> Path:
    torch.manual_seed(0)
    model = ResNet50Shaped().eval().half().to(memory_format=torch.channels_last)
    path = root / "resnet" / "v1" / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def in_process(path: Path, seconds: float) -> dict:
    code = f"""
import json, time, numpy as np, torch
m = torch.jit.load({str(path)!r}, map_location="cuda:0").eval()
out, lat = {{}}, []
with torch.inference_mode():
    for b in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(b, *{list(SHAPE)!r}, device="cuda:0", dtype=torch.float16)
        for _ in range(5): m(x)
        torch.cuda.synchronize()
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < {seconds}:
            t = time.perf_counter(); m(x); torch.cuda.synchronize()
            if b == 1: lat.append(time.perf_counter() - t)
            done += b
        out[str(b)] = round(done / (time.perf_counter() - start), 1)
print(json.dumps({{"batch1_p50_ms": round(float(np.percentile(lat, 50)) * 1000, 3), "samples_per_s": out,
                  "best_samples_per_s": max(out.values())}}))
"""
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here; bench/gpu.py needs one", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="inferd-gpubench-"))
    path = build(workdir / "repo")
    reference = in_process(path, 2.0)
    rows = [{"kind": "reference", "device": torch.cuda.get_device_name(0), **reference}]
    model = {"resnet": {"repository": str(path.parent.parent), "max_batch_size": 64,
                        "inputs": [{"dtype": "float16", "shape": list(SHAPE)}],
                        "warmup_batch_sizes": [1, 2, 4, 8, 16, 32, 64]}}
    for streams in (1, 2, 4):
        daemon = start_daemon(workdir / f"s{streams}", model,
                              workers={"devices": ["cuda:0"], "streams": streams, "shm_mb": 2048})
        try:
            for concurrency in (1, 64):
                result = run_loadgen(daemon.endpoint, "resnet", SHAPE, concurrency, args.seconds, dtype="float16")
                stats = daemon.call("stats")["models"]["resnet"]
                rows.append({"kind": "inferd", "streams": streams, **result,
                             "mean_batch": stats["batch_size"]["mean"]})
        finally:
            daemon.stop()
    record("gpu", rows)
    best = reference["best_samples_per_s"]
    print(f"\nin-process on {rows[0]['device']}: batch-1 p50 {reference['batch1_p50_ms']} ms, "
          f"best {best} samples/s ({reference['samples_per_s']})\n")
    print(table(
        ["streams", "concurrency", "samples/s", "x best in-process", "p50 ms", "p99 ms", "mean batch"],
        [[r["streams"], r["concurrency"], r["samples_per_s"], f"{r['samples_per_s'] / best:.2f}",
          r["latency_ms"]["p50"], r["latency_ms"]["p99"], r["mean_batch"]] for r in rows if r["kind"] == "inferd"],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
