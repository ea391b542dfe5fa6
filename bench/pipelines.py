"""What a pipeline costs and gains: the image pipeline of examples/pipelines against its steps chained by hand,
and a balanced pipeline, where its CPU step and its model step overlap.

    python -m bench.pipelines [--seconds 5] [--step-ms 5]

1. `classify` (JPEG bytes -> thumbnail, a Python step with Pillow -> ResNet-18 at 32x32, random weights, exported
   -> top5, a Python step), served as examples/pipelines/inferd.toml writes it (ResNet-18 from tests/models.py,
   as torchvision's cannot load on every machine), at C=1 and C=32 (requests in flight, one JPEG each) over
   ZeroMQ, against (a) the same three steps called in this process one after another (one image at a time for
   C=1, 32 at a time for C=32), and (b) this process calling the three models itself over HTTP (Triton's
   client, C threads each chaining its calls), and beside each step called alone through inferd at C=1 and 32.
   At C=32 the pipeline is also set against what its steps allow when they share the cores: one over the sum of
   one over each step's throughput alone. The daemon's CPU per request is measured for the pipeline and for
   (b), and at C=1 where the pipeline's time goes: its steps' compute (each step's from the daemon's stats,
   against the same step's called alone), the daemon's time between them, and the client's way in and out.
   Targets: the pipeline at C=32 at least 0.8x its slowest step's own throughput, and at least (b)'s with less
   CPU per request; at C=1 its median latency at most the in-process chain's + 1 ms.
2. `balanced` (a Python step that loops in Python for --step-ms, then a TorchScript model that computes for about
   as long, one request a batch) at C=32 against the same two steps called in this process one after another,
   in turns (pipeline, chain, pipeline, ...: what else the machine runs meets both alike), the median of the
   turns' ratios. Target: at least 1.6x, which only overlap gives.
3. What a hop costs: pipelines of one and of three steps of a model that computes almost nothing (TorchScript,
   one 256 x 256 layer), at C=1, beside the model called alone; a hop (a step's answer taken by the supervisor
   and the next step's request sent to its worker) costs half of what three steps take over one.

Every row is a JSON line, also appended to bench/results/pipelines.jsonl, with the machine's load average; the
table at the end gives the ratios, each of two numbers measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from bench.common import ROOT, record, table
from bench.steps import BUSY, daemon_cpu_s
from inferd.client.call import Reply
from inferd.harness import DaemonProcess, free_port, local_config

EXAMPLES = ROOT / "examples"
BALANCED_TURNS = 3


class Work(torch.nn.Module):
    """float32 [256] -> [256]: `rounds` matrix products, a model step of a chosen cost."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds
        self.layer = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.rounds):
            x = torch.tanh(self.layer(x))
        return x


def load(path: Path, name: str) -> ModuleType:
    """The module of file `path`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(folder: Path, parameters: dict[str, Any] | None = None) -> Any:
    """The Model of `folder`/v1/model.py, made in this process as a step makes it."""
    from inferd.step.runner import ModelContext

    module = load(folder / "v1" / "model.py", f"bench_{folder.name}")
    context = ModelContext(folder / "v1", folder.name, "v1", parameters or {})
    return module.Model(context) if parameters is not None else module.Model()


def ms_per_call(call: Callable[[], Any], calls: int = 20) -> float:
    for _ in range(3):  # TorchScript optimizes a module over its first calls
        call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e3


def build(root: Path, step_ms: float) -> dict[str, Any]:
    """examples/ copied into `root` with ResNet-18 saved, and the balanced pipeline's two steps, each tuned in this
    process to take `step_ms` a sample; the models' config."""
    shutil.copytree(EXAMPLES, root / "examples")
    pipelines = root / "examples" / "pipelines"
    test_models = load(ROOT / "tests" / "models.py", "bench_test_models")
    torch.manual_seed(0)
    load(pipelines / "export.py", "bench_export").export_classifier(test_models.ResNet18(), pipelines / "resnet18")
    written = tomllib.loads((pipelines / "inferd.toml").read_text())
    served = {name: {**body, "repository": str((pipelines / body["repository"]).resolve())}
              for name, body in written["models"].items() if name in ("thumbnail", "resnet18", "top5")}
    (root / "busy" / "v1").mkdir(parents=True)
    (root / "busy" / "v1" / "model.py").write_text(BUSY)
    x = np.zeros((1, 256), np.float32)

    def busy_ms(loops: int) -> float:
        busy = step(root / "busy", {"loops": loops})
        return ms_per_call(lambda: busy({"INPUT__0": x}))

    def work_ms(rounds: int) -> float:
        work = torch.jit.script(Work(rounds).eval())
        with torch.no_grad():
            return ms_per_call(lambda: work(torch.from_numpy(x)))

    loops, rounds = tuned(busy_ms, 10_000, step_ms), tuned(work_ms, 100, step_ms)
    (root / "work" / "v1").mkdir(parents=True)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(Work(rounds).eval()), str(root / "work" / "v1" / "model.pt"))
    one = {"max_batch_size": 1, "warmup_batch_sizes": [1]}
    served["busy"] = {**one, "repository": str(root / "busy"), "parameters": {"loops": loops},
                      "inputs": [{"dtype": "float32", "shape": [256]}],
                      "outputs": [{"dtype": "float32", "shape": [256]}]}
    served["work"] = {**one, "repository": str(root / "work"), "inputs": [{"dtype": "float32", "shape": [256]}]}
    (root / "hop" / "v1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(Work(1).eval()), str(root / "hop" / "v1" / "model.pt"))
    served["hop"] = {"repository": str(root / "hop"), "inputs": [{"dtype": "float32", "shape": [256]}]}
    return {"models": served, "pipelines": {"classify": written["pipelines"]["classify"], "balanced": {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [256]}], "outputs": ["out"],
        "steps": [{"model": "busy", "inputs": {"INPUT__0": "x"}, "outputs": {"OUTPUT__0": "y"}},
                  {"model": "work", "inputs": {"INPUT__0": "y"}, "outputs": {"OUTPUT__0": "out"}}]},
        "hop1": hops(1), "hop3": hops(3)},
        "loops": loops, "rounds": rounds}


def tuned(ms_at: Callable[[int], float], size: int, step_ms: float) -> int:
    """The size (loops, rounds) at which a step takes `step_ms` a call, as `ms_at(size)` measures it on the step as
    it is served (a scripted module, not the eager one, whose every operation costs more): scaled from `size`,
    then measured at that size and scaled once more, as the cost is not quite linear in it."""
    for _ in range(2):
        size = max(1, round(size * step_ms / ms_at(size)))
    return size


def hops(count: int) -> dict[str, Any]:
    """A pipeline of `count` steps of the model `hop`, one after the other."""
    tensors = ["x", *(f"t{i}" for i in range(count))]
    return {"inputs": [{"name": "x", "dtype": "float32", "shape": [256]}], "outputs": [tensors[-1]],
            "steps": [{"name": f"hop{i}", "model": "hop", "inputs": {"INPUT__0": tensors[i]},
                       "outputs": {"OUTPUT__0": tensors[i + 1]}} for i in range(count)]}


def jpeg() -> np.ndarray:
    """One 256x192 JPEG of random pixels, as a request's input: object [1, 1]."""
    from PIL import Image

    encoded = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (192, 256, 3), np.uint8)).save(encoded, "JPEG")
    return np.array([[encoded.getvalue()]], dtype=object)


def closed_loop(submit: Callable[[], Future], concurrency: int, seconds: float) -> dict[str, Any]:
    """Keep `concurrency` requests in flight for `seconds`; requests answered a second and their latencies, and
    where `submit` asks the daemon's timing (`details`), the medians of its compute and total.

    Each answer sends the next request from its future's callback, on the client's I/O thread: waiting on the
    futures in flight instead cost this process about twice the CPU a request, taken from the cores the daemon
    is measured on."""
    latencies: list[float] = []
    timings: list[Any] = []
    failures: list[BaseException] = []
    unfinished = concurrency
    lock = threading.Lock()
    finished = threading.Event()
    started = time.perf_counter()
    stop = started + seconds

    def send() -> None:
        sent = time.perf_counter()
        try:
            future = submit()
        except BaseException as exc:  # noqa: BLE001 - raised again by closed_loop, in its own thread
            failures.append(exc)
            end_one()
            return
        future.add_done_callback(lambda done: answered(done, sent))

    def answered(future: Future, sent: float) -> None:
        now = time.perf_counter()
        latencies.append(now - sent)
        try:
            reply = future.result()
        except BaseException as exc:  # noqa: BLE001 - as in send()
            failures.append(exc)
        else:
            if isinstance(reply, Reply):
                timings.append(reply.timing_us)
        if now < stop and not failures:
            send()
        else:
            end_one()

    def end_one() -> None:
        nonlocal unfinished
        with lock:
            unfinished -= 1
            if not unfinished:
                finished.set()

    for _ in range(concurrency):
        send()
    finished.wait()
    if failures:
        raise failures[0]
    row = summary(latencies, time.perf_counter() - started)
    if timings:
        row["compute_p50_ms"] = round(statistics.median(t.compute for t in timings) / 1e3, 2)
        row["daemon_p50_ms"] = round(statistics.median(t.total for t in timings) / 1e3, 2)
    return row


def summary(latencies: list[float], elapsed: float) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {"requests": len(ordered), "requests_per_s": round(len(ordered) / elapsed, 1),
            "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 2)}


def threads(chain: Callable[[int], Callable[[], Any]], concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` threads, each calling its own `chain(index)` until `seconds` pass."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.perf_counter() + seconds
    torch_threads = torch.get_num_threads()  # what measure() set

    def run(index: int) -> None:
        # A new thread computes on OpenMP's default team, a thread per core, until its own count is set: the
        # in-process chains compute on measure()'s, as the workers' executors do on workers.cpu_threads.
        torch.set_num_threads(torch_threads)
        call = chain(index)
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            call()
            latencies[index].append(time.perf_counter() - sent)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(concurrency)))
    return summary([s for each in latencies for s in each], time.perf_counter() - started)


def with_cpu(daemon: DaemonProcess, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measure()`'s row, with the CPU time the daemon's processes, and this one (the clients), spent per request
    meanwhile."""
    before, ours = daemon_cpu_s(daemon), time.process_time()
    row = measure()
    row["daemon_cpu_us_per_request"] = round((daemon_cpu_s(daemon) - before) / row["requests"] * 1e6, 1)
    row["client_cpu_us_per_request"] = round((time.process_time() - ours) / row["requests"] * 1e6, 1)
    return row


def http_chain(address: str, image: np.ndarray) -> Callable[[int], Callable[[], Any]]:
    """(b): the three models called one after the other over HTTP, by a client of each thread's own."""
    import tritonclient.http as httpclient

    def make(_: int) -> Callable[[], Any]:
        client = httpclient.InferenceServerClient(address)

        def call(model: str, name: str, array: np.ndarray, dtype: str) -> np.ndarray:
            given = httpclient.InferInput(name, list(array.shape), dtype)
            given.set_data_from_numpy(array)
            result = client.infer(model, [given])
            return result.as_numpy(result.get_response()["outputs"][0]["name"])

        return lambda: call("top5", "logits", call("resnet18", "INPUT__0", call("thumbnail", "image", image, "BYTES"),
                                                    "FP32"), "FP32")

    return make


def in_process_image(models: dict[str, Any], image: np.ndarray, batch: int, seconds: float) -> dict[str, Any]:
    """(a): the three steps in this process, one after the other, on `batch` images at a time."""
    thumbnail, top5 = step(Path(models["thumbnail"]["repository"])), step(Path(models["top5"]["repository"]))
    resnet = torch.export.load(str(Path(models["resnet18"]["repository"]) / "v1" / "model.pt2")).module()
    images = np.repeat(image, batch, axis=0)

    def chain() -> None:
        with torch.no_grad():
            top5({"logits": resnet(torch.from_numpy(thumbnail({"image": images})["pixels"])).numpy()})

    row = threads(lambda _: chain, 1, seconds)
    row["samples_per_s"] = round(row["requests_per_s"] * batch, 1)
    return row


def in_process_balanced(root: Path, loops: int, seconds: float) -> dict[str, Any]:
    busy = step(root / "busy", {"loops": loops})
    work = torch.jit.load(str(root / "work" / "v1" / "model.pt"))
    x = np.zeros((1, 256), np.float32)

    def chain() -> None:
        with torch.no_grad():
            work(torch.from_numpy(busy({"INPUT__0": x})["OUTPUT__0"]))

    # Each step's own time is measured now, just before the chain (the machine's load changes what a step takes),
    # which also leaves the module's first, unoptimized, calls out of the chain.
    with torch.no_grad():
        work_ms = ms_per_call(lambda: work(torch.from_numpy(x)), 50)
    busy_ms = ms_per_call(lambda: busy({"INPUT__0": x}))
    return {**threads(lambda _: chain, 1, seconds), "busy_ms": round(busy_ms, 2), "work_ms": round(work_ms, 2)}


def measure(root: Path, seconds: float, step_ms: float) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # as each of the daemon's executors computes (workers.cpu_threads = 1)
    built = build(root, step_ms)
    models = built["models"]
    http = f"127.0.0.1:{free_port()}"
    (root / "daemon").mkdir()
    config = local_config(root / "daemon", models, queue={"max_size": 4096}, server={"http": http},
                          workers={"cpu_threads": 1})
    daemon = DaemonProcess(root / "daemon", {**config, "pipelines": built["pipelines"]}).start(timeout=120)
    image = jpeg()
    pixels = np.random.default_rng(1).random((1, 3, 32, 32), np.float32)
    logits = np.random.default_rng(2).standard_normal((1, 1000)).astype(np.float32)
    x = np.zeros((1, 256), np.float32)
    load_average = {"load_average": round(os.getloadavg()[0], 2)}
    rows: list[dict[str, Any]] = []

    def add(**row: Any) -> None:
        rows.append({**row, **load_average})
        print(rows[-1], file=sys.stderr, flush=True)

    try:
        with daemon.client(timeout=60.0) as client:
            for concurrency in (1, 32):
                closed_loop(lambda: client.submit("classify", image), concurrency, 1.0)  # warm
                add(part="image", way="pipeline, ZeroMQ", concurrency=concurrency, **with_cpu(
                    daemon, lambda c=concurrency: closed_loop(lambda: client.submit("classify", image, details=True),
                                                              c, seconds)))
                if concurrency == 1:  # so far the pipeline has served only one request at a time
                    steps = daemon.call("stats")["pipelines"]["classify"]["steps"]
                    rows[-1]["step_compute_p50_ms"] = {name: step["compute_ms"]["p50"] for name, step in steps.items()}
                add(part="image", way="client chains the models, HTTP", concurrency=concurrency, **with_cpu(
                    daemon, lambda c=concurrency: threads(http_chain(http, image), c, seconds)))
                add(part="image", way="in-process chain", concurrency=concurrency,
                    **in_process_image(models, image, concurrency, seconds))
            for model, given in (("thumbnail", image), ("resnet18", pixels), ("top5", logits)):
                for concurrency in (1, 32):
                    add(part="image", way=f"step {model} alone, ZeroMQ", concurrency=concurrency,
                        **closed_loop(lambda m=model, g=given: client.submit(m, g, details=True), concurrency,
                                      seconds))
            closed_loop(lambda: client.submit("balanced", x), 32, 1.0)
            for turn in range(BALANCED_TURNS):
                add(part="balanced", way="pipeline, ZeroMQ", concurrency=32, step_ms=step_ms, turn=turn, **with_cpu(
                    daemon, lambda: closed_loop(lambda: client.submit("balanced", x), 32, seconds)))
                add(part="balanced", way="in-process chain", concurrency=1, step_ms=step_ms, turn=turn,
                    **in_process_balanced(root, built["loops"], seconds))
            for name in ("hop", "hop1", "hop3"):
                closed_loop(lambda n=name: client.submit(n, x), 1, 1.0)
                add(part="hops", way=name, concurrency=1, **closed_loop(lambda n=name: client.submit(n, x), 1, seconds))
    finally:
        daemon.stop()
    return rows


def pick(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any]:
    return next(r for r in rows if all(r.get(k) == v for k, v in where.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--step-ms", type=float, default=5.0, help="each step's time a sample, in the balanced one")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="inferd-pipelines-"))
    try:
        rows = measure(root, args.seconds, args.step_ms)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record("pipelines", rows)
    lines = []
    for concurrency in (1, 32):
        pipe = pick(rows, part="image", way="pipeline, ZeroMQ", concurrency=concurrency)
        http = pick(rows, part="image", way="client chains the models, HTTP", concurrency=concurrency)
        local = pick(rows, part="image", way="in-process chain", concurrency=concurrency)
        lines.append([f"image, C={concurrency}", f"{pipe['requests_per_s']}/s, p50 {pipe['p50_ms']} ms, "
                      f"{pipe['daemon_cpu_us_per_request']:.0f} µs CPU", f"{http['requests_per_s']}/s, p50 "
                      f"{http['p50_ms']} ms, {http['daemon_cpu_us_per_request']:.0f} µs CPU",
                      f"{local['samples_per_s']}/s, p50 {local['p50_ms']} ms",
                      f"{pipe['requests_per_s'] / http['requests_per_s']:.2f}x (b), "
                      f"{pipe['requests_per_s'] / local['samples_per_s']:.2f}x (a)"])
    alone = [r for r in rows if r["way"].startswith("step ") and r["concurrency"] == 1]
    pipe = pick(rows, part="image", way="pipeline, ZeroMQ", concurrency=1)
    lines.append(["image, C=1, against its steps called alone", f"p50 {pipe['p50_ms']} ms", "",
                  f"p50s added {sum(r['p50_ms'] for r in alone):.2f} ms", ""])
    lines.append(["image, C=1, where its time goes (p50s)", f"steps compute {pipe['compute_p50_ms']} ms, between "
                  f"them {pipe['daemon_p50_ms'] - pipe['compute_p50_ms']:.2f} ms, the client's way "
                  f"{pipe['p50_ms'] - pipe['daemon_p50_ms']:.2f} ms", "", "steps compute alone "
                  f"{sum(r['compute_p50_ms'] for r in alone):.2f} ms", ""])
    lines.append(["image, C=1, each step's compute (p50)", ", ".join(
        f"{name} {ms} ms" for name, ms in pipe["step_compute_p50_ms"].items()), "", ", ".join(
        f"{r['way'].split()[1]} {r['compute_p50_ms']} ms" for r in alone), ""])
    slowest = min((r for r in rows if r["way"].startswith("step ") and r["concurrency"] == 32),
                  key=lambda r: r["requests_per_s"])
    pipe = pick(rows, part="image", way="pipeline, ZeroMQ", concurrency=32)
    lines.append([f"image, C=32, against its slowest step ({slowest['way'].split()[1]})",
                  f"{pipe['requests_per_s']}/s", "", f"{slowest['requests_per_s']}/s alone",
                  f"{pipe['requests_per_s'] / slowest['requests_per_s']:.2f}x (target >= 0.8x)"])
    # On cores that every step shares, a request costs the sum of what each step costs a request alone.
    shared = 1 / sum(1 / r["requests_per_s"] for r in rows if r["way"].startswith("step ") and r["concurrency"] == 32)
    lines.append(["image, C=32, against its steps sharing the cores", f"{pipe['requests_per_s']}/s", "",
                  f"{shared:.1f}/s: 1 / the sum of 1 / each alone", f"{pipe['requests_per_s'] / shared:.2f}x"])
    ratios: list[float] = []
    for turn in range(BALANCED_TURNS):
        pipe = pick(rows, part="balanced", way="pipeline, ZeroMQ", turn=turn)
        local = pick(rows, part="balanced", way="in-process chain", turn=turn)
        ratios.append(pipe["requests_per_s"] / local["requests_per_s"])
        lines.append([f"balanced, turn {turn + 1} ({local['busy_ms']} ms + {local['work_ms']} ms in-process), C=32",
                      f"{pipe['requests_per_s']}/s, {pipe['daemon_cpu_us_per_request']:.0f} µs CPU + the client's "
                      f"{pipe['client_cpu_us_per_request']:.0f} µs", "", f"{local['requests_per_s']}/s",
                      f"{ratios[-1]:.2f}x"])
    lines.append(["balanced, the turns' median", "", "", "", f"{statistics.median(ratios):.2f}x (target >= 1.6x)"])
    alone, one, three = (pick(rows, part="hops", way=name) for name in ("hop", "hop1", "hop3"))
    lines.append(["a hop, C=1: half of (3 steps - 1 step)", f"{(three['p50_ms'] - one['p50_ms']) / 2:.2f} ms",
                  "", f"the model alone {alone['p50_ms']} ms, in a pipeline of 1 {one['p50_ms']} ms", ""])
    print(table(["measure", "pipeline (ZeroMQ)", "(b) client chains, HTTP", "(a) in-process chain", "ratio"], lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
