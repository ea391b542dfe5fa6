"""The compute reference: the model called in this process, with the worker's torch thread count.

    python -m bench.inprocess MODEL_FILE --shape 256 [--threads 1] [--device cuda:0 --dtype float16] [--compile]

MODEL_FILE is TorchScript, a torch.export program or an AOTInductor package, loaded
the way PyTorch documents for each (told by what the file holds). With --compile,
a program is compiled with torch.compile (inductor, dynamic shapes) as a worker
with compile = "inductor" does; the compile happens in the warm-up calls.

Prints one JSON line: p50 latency at batch 1, back to back and after an idle
gap like a served model has between requests at concurrency 1; and samples/s
at each batch size up to --max-batch (the best of them is the compute limit).
On a GPU each call is waited for (the device runs behind the host).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

IDLE_GAP_S = 0.001  # about what a request at concurrency 1 spends outside the model, in the daemon and on the wire


def measure(path: str, shape: tuple[int, ...], threads: int, max_batch: int, seconds: float,
            device: str = "cpu", dtype: str = "float32", compile_it: bool = False) -> dict:
    """Batch-1 latency percentiles (back to back, and after IDLE_GAP_S asleep) and throughput per
    batch size, each measured for about `seconds`, with inputs of `dtype` on `device`."""
    torch.set_num_threads(threads)
    loaded = load(path, device)
    if compile_it:
        loaded = torch.compile(loaded, backend="inductor", dynamic=True)
    wait = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def module(x: torch.Tensor) -> None:
        loaded(x)
        wait()

    latencies: list[float] = []
    throughput: dict[int, float] = {}
    with torch.inference_mode():
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch]
        for batch in sizes:
            x = torch.randn(batch, *shape, device=device).to(getattr(torch, dtype))
            for _ in range(5):
                module(x)
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                t = time.perf_counter()
                module(x)
                if batch == 1:
                    latencies.append(time.perf_counter() - t)
                done += batch
            throughput[batch] = done / (time.perf_counter() - started)
        # A model served one request at a time waits between calls; on a shared or
        # virtual machine its core and caches go cold meanwhile.
        after_idle: list[float] = []
        x = torch.randn(1, *shape, device=device).to(getattr(torch, dtype))
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            time.sleep(IDLE_GAP_S)
            t = time.perf_counter()
            module(x)
            after_idle.append(time.perf_counter() - t)
    return {
        "batch1_latency_ms": _percentiles_ms(latencies),
        "batch1_after_idle_latency_ms": _percentiles_ms(after_idle),
        "samples_per_s": {str(b): round(v, 1) for b, v in throughput.items()},
        "best_samples_per_s": round(max(throughput.values()), 1),
        "threads": threads,
    }


def load(path: str, device: str = "cpu") -> Any:
    """The model in `path`, ready to call on `device`, whatever format the file holds (an AOTInductor
    package runs where it was compiled for)."""
    from inferd.models import model_files

    found = model_files.inspect(Path(path))
    if found.format == model_files.AOTI:
        return torch._inductor.aoti_load_package(path)
    if found.format == model_files.EXPORTED:
        return torch.export.load(path).module().to(device)
    return torch.jit.load(path, map_location=device).eval()


def _percentiles_ms(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000
    return {"p50": round(float(np.percentile(ms, 50)), 4), "p99": round(float(np.percentile(ms, 99)), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_file")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=2.0, help="per batch size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="of the inputs")
    parser.add_argument("--compile", action="store_true", help="compile a torch.export program with inductor")
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    print(json.dumps(measure(args.model_file, shape, args.threads, args.max_batch, args.seconds, args.device,
                             args.dtype, args.compile)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
