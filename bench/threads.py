"""Whether a format computes on two threads of one process at once: the cnn as TorchScript and as an
AOTInductor package, called from one thread and from two (one torch thread each, as a worker's executors).

    python -m bench.threads [--seconds 3]

Prints samples/s at batch 8 for each, and for the package two loaders on two threads too: a worker's
executors are threads of one process, so a format that holds the GIL while it computes makes them take turns.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import models
from bench.common import record, table
from bench.formats import build


def rate(calls: list[Callable[[torch.Tensor], Any]], seconds: float) -> float:
    """Samples/s at batch 8 with one thread per entry of `calls`, each calling its own for `seconds`."""
    x = torch.randn(8, *models.CNN_SHAPE)
    done = [0] * len(calls)
    stop = time.monotonic() + seconds

    def work(k: int) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            while time.monotonic() < stop:
                calls[k](x)
                done[k] += len(x)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return round(sum(done) / seconds, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="inferd-threads-"))
    build(repo, "cnn", models.CNN_SHAPE, 16)
    from torch._inductor.package import load_package

    script = torch.jit.load(str(repo / "cnn" / "torchscript" / "model.pt"))
    package = str(repo / "cnn" / "aoti" / "model.pt2")
    shared = load_package(package, num_runners=2)
    row = {"torchscript": {"1 thread": rate([script], args.seconds), "2 threads": rate([script, script], args.seconds)},
           "aoti": {"1 thread": rate([shared], args.seconds), "2 threads": rate([shared, shared], args.seconds),
                    "2 threads, a loader each": rate([load_package(package), load_package(package)], args.seconds)}}
    record("threads", [row])
    print(table(["format", "1 thread", "2 threads", "2 threads, a loader each"],
                [[name, r["1 thread"], r["2 threads"], r.get("2 threads, a loader each", "")]
                 for name, r in row.items()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
