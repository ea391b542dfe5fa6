"""Models on one device: load a version, warm it up, run a batch.

Files are read with TorchScript (`torch.jit.load`), torch.export
(`torch.export.load`) or AOTInductor's loader, whichever the file holds
(model_files), never with a bare pickle `torch.load`. An AOTInductor package
gets one runner per executor: a runner computes one batch at a time.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import psutil
import torch

from inferd.arrays import from_numpy, to_numpy
from inferd.compute.executor import describe_error
from inferd.config.schema import CANARY_ATOL, CANARY_RTOL, ModelConfig
from inferd.ipc.messages import LoadedModel, TensorSpec
from inferd.models import model_files
from inferd.models.repository import model_file, writable_by_others
from inferd.protocol import DTYPES, tensor_bytes
from inferd.worker import padding_check
from inferd.worker.graphs import Capture, CudaCapture, Graph, Graphs

log = logging.getLogger("inferd.worker.runner")

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ModelError(Exception):
    """A model cannot be loaded, warmed up or run; the message says why."""


def load_module(found: model_files.ModelFile, device: torch.device, config: ModelConfig, runners: int = 1) -> Any:
    """Load a TorchScript, torch.export or AOTInductor file onto `device`, in eval mode, by what the file holds
    (`found` by model_files.inspect, whatever its name); a torch.export program must take every batch size
    `config` warms up, and an AOTInductor package gets `runners` runners (one per executor) and must have been
    compiled for `device`."""
    path = found.path
    if found.problem is not None:
        raise ModelError(found.problem)
    if found.format == model_files.AOTI:
        return _load_aoti(path, device, config, found.made, runners)
    module: Any
    try:
        if found.format == model_files.EXPORTED:
            program = torch.export.load(str(path))
            _check_batch_dim(program, path, config)
            module = program.module().to(device)
            if config.compile == "inductor":  # compiled by the warm-up's first calls, before any request
                module = torch.compile(module, backend="inductor", dynamic=True)
        else:
            module = torch.jit.load(str(path), map_location=device)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad archive
        made_by = model_files.inspect(path, provenance=True).made.get("torch_version")
        if made_by and made_by != torch.__version__:
            raise ModelError(f"{path} was exported by torch {made_by}, which this worker's torch {torch.__version__} "
                             f"cannot load ({describe_error(exc)}); export it again with this torch") from None
        raise ModelError(f"{path} is not a loadable TorchScript or torch.export file: {describe_error(exc)}") from None
    # torch.export modules reject .eval(); they are traced in eval mode already.
    if isinstance(module, torch.jit.ScriptModule):
        module.eval()
    return module


def _load_aoti(path: Path, device: torch.device, config: ModelConfig, made: dict[str, str], runners: int) -> Any:
    compiled_for = made.get("device")
    if compiled_for is not None and compiled_for != device.type:
        raise ModelError(f"{path} is an AOTInductor package compiled for {compiled_for}, but this worker runs on "
                         f"{device}; compile it for {device.type} (inferd convert --format aoti --device "
                         f"{device.type})")
    if config.precision != "fp32":
        raise ModelError(f"{path} is an AOTInductor package, which computes in the precision it was compiled in; "
                         "set precision = \"fp32\" (and compile it in the precision wanted)")
    from torch._inductor.package import load_package

    try:
        package = load_package(str(path), num_runners=max(1, runners),
                               device_index=device.index if device.index is not None else -1)
    except Exception as exc:  # noqa: BLE001 - a package another torch built fails in many ways
        raise ModelError(f"{path} is an AOTInductor package this worker's torch {torch.__version__} cannot load "
                         f"({describe_error(exc)}); compile it again with this torch") from None
    return package if device.type == "cuda" else AllCoresPackage(package, max(1, runners) * torch.get_num_threads())


class AllCoresPackage:
    """An AOTInductor package on the CPU, each call computing on the OpenMP threads of all the worker's
    executors (`threads`), not on its own executor's workers.cpu_threads; the worker runs it on one executor.

    Its Python binding holds the GIL while it computes, so a worker's executors take turns on it: on one
    thread each, two executors served bench.formats' cnn at 0.67x TorchScript, where two workers of one
    executor served it at 1.31x. One call as wide as the worker uses every core the worker has."""

    def __init__(self, package: Any, threads: int) -> None:
        self.package = package
        self.threads = threads

    def __call__(self, *inputs: torch.Tensor) -> Any:
        own = torch.get_num_threads()  # OpenMP's count is the calling thread's: its executor's, put back after
        torch.set_num_threads(self.threads)
        try:
            return self.package(*inputs)
        finally:
            torch.set_num_threads(own)


def _check_batch_dim(program: Any, path: Path, config: ModelConfig) -> None:
    """Refuse a program exported with a fixed batch size where batches of other sizes will come: its
    guards would fail every one of them."""
    sizes = {config.max_batch_size, *(config.warmup_batch_sizes or (1,))}
    user_inputs = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" and node.name in user_inputs else None
        shape = getattr(value, "shape", None)
        if shape and isinstance(shape[0], int) and sizes != {shape[0]}:
            raise ModelError(
                f"{path} was exported with a fixed batch size of {shape[0]} (input {node.name!r}), but batches "
                f"of up to {config.max_batch_size} come; export it with a dynamic batch dim: "
                "torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim(\"batch\")},)), "
                "one dict per input")


def model_memory(module: Any, path: Path) -> int:
    """The bytes a loaded module's weights hold on the CPU: its parameters and buffers; for an AOTInductor
    package, whose weights the torch API does not show, its file's size."""
    if not isinstance(module, torch.nn.Module):
        return path.stat().st_size
    tensors = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def warmup_shapes(config: ModelConfig) -> list[tuple[tuple[int, ...], ...]]:
    """The per-sample input shapes a version is warmed up at: each shape bucket a padded batch may have, and
    max_shape (for fixed shapes, theirs). The largest comes last: the signature is taken there."""
    bounds = tuple(spec.bound for spec in config.inputs)
    buckets = [tuple(tuple(min(bucket, most) if dim == -1 else dim for dim, most in zip(spec.shape, spec.bound))
                     for spec in config.inputs) for bucket in config.shape_buckets]
    return [*dict.fromkeys(shape for shape in buckets if shape != bounds), bounds]


def warmup_sizes(config: ModelConfig) -> list[int]:
    """The batch sizes a version is warmed up at: its buckets, and the warm-up sizes above the largest (a
    smaller one is run at its bucket's size anyway)."""
    largest = max(config.batch_buckets, default=0)
    return [*config.batch_buckets, *(size for size in config.warmup_batch_sizes or (1,) if size > largest)]


def as_outputs(result: Any) -> tuple[torch.Tensor, ...]:
    """A model's return value as a tuple of tensors."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result)
    raise ModelError(f"the model returned {type(result).__name__}; return a tensor or a tuple of tensors")


CANARY_INPUT, CANARY_OUTPUT = "example_input.npy", "expected_output.npy"


class Staged(NamedTuple):
    """A batch on the device, ready to run: its inputs padded to its bucket (a graph's own buffers where one
    was captured at that shape), and its own number of samples."""

    inputs: list[torch.Tensor]
    samples: int
    graph: Graph | None


class Loaded:
    """A model version on the device, the precision it computes in, the batch sizes it is run at, and
    where it has CUDA graphs, each executor's."""

    def __init__(self, module: Any, precision: torch.dtype, buckets: tuple[int, ...] = (),
                 graphs: Sequence[Graphs] = ()) -> None:
        self.module = module
        self.precision = precision
        self.buckets = buckets
        self.graphs = graphs

    def __call__(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run one batch without a graph (warm-up, the canary); its outputs cut back to its own samples."""
        return self.run(self.stage(inputs))

    def stage(self, inputs: list[torch.Tensor], device: torch.device | None = None,
              lane: int | None = None) -> Staged:
        """Put a batch (wherever it lies) on `device`, padded up to its bucket with copies of its last sample
        (values the model has seen, never a row of zeros): into the buffers of executor `lane`'s graph where
        one was captured at that shape."""
        samples = inputs[0].shape[0]
        batch = next((size for size in self.buckets if size >= samples), samples)
        graph = self.graphs[lane].find(batch, inputs) if lane is not None and self.graphs else None
        if graph is not None:
            graph.fill(inputs)
            return Staged(graph.inputs, samples, graph)
        if device is not None:
            inputs = [x.to(device, non_blocking=True) for x in inputs]
        if batch > samples:
            inputs = [torch.cat([x, x[-1:].expand(batch - samples, *x.shape[1:])]) for x in inputs]
        return Staged(inputs, samples, None)

    def run(self, staged: Staged) -> tuple[torch.Tensor, ...]:
        """Compute a staged batch (replaying its graph if it has one); outputs cut back to its own samples."""
        outputs = staged.graph.replay() if staged.graph is not None else self.forward(staged.inputs)
        batch = staged.inputs[0].shape[0]
        for index, output in enumerate(outputs):
            if output.dim() == 0 or output.shape[0] != batch:
                raise ModelError(
                    f"output {index} has shape {list(output.shape)}; its first dim must be the batch size {batch}"
                )
        return outputs if batch == staged.samples else tuple(y[:staged.samples] for y in outputs)

    def forward(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The model on a batch as it is: floating inputs cast to its precision, floating outputs back to
        float32 (what a graph captures)."""
        if self.precision != torch.float32:
            inputs = [x.to(self.precision) if x.is_floating_point() else x for x in inputs]
        with torch.inference_mode():
            outputs = as_outputs(self.module(*inputs))
        if self.precision != torch.float32:
            outputs = tuple(y.float() if y.is_floating_point() else y for y in outputs)
        return outputs


class ModelRunner:
    """The models loaded on one device, by name and version."""

    def __init__(self, device: torch.device, executors: int = 1,
                 capture: Callable[[torch.device], Capture] | None = None) -> None:
        self.device = device
        self.executors = executors  # each may run a batch of the same model at once
        # How an executor's CUDA graphs are captured: by CUDA on a GPU; the CPU has no graphs (the tests
        # give it a stand-in that replays eagerly, to run the rest of the graph path).
        self._new_capture = capture or (CudaCapture if device.type == "cuda" else None)
        self._models: dict[tuple[str, str], Loaded] = {}

    def load(
        self,
        name: str,
        config: ModelConfig,
        version: str,
        expect: tuple[TensorSpec, ...] | None = None,
        memory_factor: float | None = None,
        streams: list[Any] | None = None,
    ) -> tuple[LoadedModel, float, float]:
        """Load and warm `version` of model `name`; return its signature and the seconds each step took.

        With `memory_factor`, first check that the device has that many times the
        file's size free. With `expect`, the outputs must have that signature. A
        version folder holding a canary (example input and expected output) must
        reproduce it. Warm-up runs on each of `streams` (the executors' CUDA
        streams), so none meets the model cold. The module becomes visible to the
        executors only once every check has passed; whatever fails, nothing of it
        stays loaded, and a copy of the same version loaded before is left as it was.
        """
        started = time.perf_counter()
        precision = PRECISIONS[config.precision]
        if precision != torch.float32 and self.device.type != "cuda":
            raise ModelError(f"{name} has precision {config.precision!r}, which needs a GPU, but this worker runs "
                             f"on {self.device}; use precision = \"fp32\" on the CPU")
        if config.cuda_graphs and self._new_capture is None:
            raise ModelError(f"{name} has cuda_graphs = true, which needs a GPU, but this worker runs on "
                             f"{self.device}; set cuda_graphs = false for a model served on the CPU")
        if config.takes_bytes:
            raise ModelError(f"{name} takes a bytes input, which a tensor program cannot; decode the byte strings "
                             "in a Python model (a version folder with model.py) and give the tensors to this one")
        try:
            path = model_file(config.repository or "", version)
        except Exception as exc:  # noqa: BLE001 - a repository error, said in one sentence
            raise ModelError(str(exc)) from None
        refusal = None if config.allow_writable else writable_by_others(name, path)
        if refusal is not None:
            raise ModelError(refusal)
        found = model_files.inspect(path)
        if found.format == model_files.PYTHON:
            raise ModelError(f"{name} {version} is a Python model (model.py), which runs in processes of its own, "
                             "not on a worker: a model keeps its kind across versions; serve it under another name")
        if config.cuda_graphs and found.format == model_files.AOTI:
            # Its runners check their own CUDA events to find a free one, which an event recorded in a
            # capture forbids (cudaErrorCapturedEvent).
            raise ModelError(f"{name} {version} is an AOTInductor package, which inferd cannot capture in a CUDA "
                             "graph; set cuda_graphs = false for this model")
        if memory_factor is not None:
            self._check_room(name, version, path, memory_factor)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        module = load_module(found, self.device, config, self.executors)
        if precision != torch.float32:
            module = module.to(precision)
        graphs = [Graphs(self._new_capture(self.device)) for _ in range(self.executors)] \
            if config.cuda_graphs and self._new_capture is not None else []
        model = Loaded(module, precision, config.batch_buckets, graphs)
        try:
            loaded = time.perf_counter()
            # Counting compilations imports torch._dynamo (0.9 s of CPU): only where inductor compiles.
            compiles = config.compile == "inductor" and found.format == model_files.EXPORTED
            compiled_before = _compile_counts() if compiles else (0, 0)
            outputs, largest_io = self._warm_up(model, name, config, version, streams or [None])
            pools = self._capture_graphs(model, config, f"{name} {version}")
            if compiles:
                misses, hits = (now - before for now, before in zip(_compile_counts(), compiled_before))
                log.info("compiled %s %s with inductor while it warmed up: %d graph(s) compiled, %d from the "
                         "compile cache", name, version, misses, hits)
            if expect is not None and outputs != expect:
                raise ModelError(
                    f"{name} {version} outputs {_describe(outputs)}, but the live version outputs "
                    f"{_describe(expect)} (allow it with --allow-signature-change)"
                )
            self._check_canary(model, name, version, path.parent)
            self._check_padding(model, name, config, version, outputs, path.parent)
        except BaseException:
            # The traceback keeps `module` alive until the caller has handled it;
            # the caller then calls release_memory() to give the memory back.
            del module, model, graphs
            raise
        self._models[(name, version)] = model
        warmed = time.perf_counter()
        if on_gpu:  # other executors' batches may run meanwhile: their peak counts too, erring on the large side
            memory = torch.cuda.max_memory_allocated(self.device) - before + pools
        else:
            memory = model_memory(module, path) + largest_io
        log.info(
            "loaded %s %s from %s in %.2f s, warmed on batch sizes %s in %.2f s; it holds %.1f MiB",
            name, version, path, loaded - started, warmup_sizes(config), warmed - loaded, memory / 2**20,
        )
        if graphs:
            log.info("captured CUDA graphs of %s %s at batch sizes %s on each of %d executors (%d graphs)", name,
                     version, list(config.batch_buckets), len(graphs), sum(map(len, graphs)))
        # A package that takes every core of the worker in each call runs on one executor: two teams of
        # OpenMP threads, each spin-waiting while the other computes, would share those cores.
        lanes = 1 if isinstance(module, AllCoresPackage) else 0
        return (LoadedModel(version=version, outputs=outputs, memory=memory, lanes=lanes), loaded - started,
                warmed - loaded)

    def unload(self, name: str, version: str) -> None:
        """Free a version, and on a GPU give its cached memory back to the device."""
        if self._models.pop((name, version), None) is None:
            return
        self.release_memory()
        log.info("unloaded %s %s", name, version)

    def release_memory(self) -> None:
        """Collect what no longer has an owner, and on a GPU return cached blocks to the device."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocator_memory(self) -> tuple[int, int]:
        """The GPU allocator's (bytes in use, bytes reserved)."""
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def trim(self) -> int:
        """Give the GPU allocator's unused cached blocks back to the device; return the bytes freed."""
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)

    def stage(self, name: str, version: str, inputs: list[torch.Tensor], lane: int) -> tuple[Loaded, Staged]:
        """Put a batch of a loaded version on the device for executor `lane` (see Loaded.stage)."""
        model = self._models.get((name, version))
        if model is None:
            raise ModelError(f"{name} {version} is not loaded on this worker")
        return model, model.stage(inputs, self.device, lane)

    @staticmethod
    def signature(outputs: tuple[torch.Tensor, ...]) -> tuple[TensorSpec, ...]:
        """Per-sample dtype and shape of each output, refusing dtypes the wire cannot carry."""
        specs = []
        for index, output in enumerate(outputs):
            name = DTYPE_NAMES.get(output.dtype)
            if name is None:
                raise ModelError(f"output {index} is {output.dtype}, which the wire cannot carry")
            specs.append(TensorSpec(name, tuple(output.shape[1:])))
        return tuple(specs)

    def _warm_up(self, model: Loaded, name: str, config: ModelConfig, version: str,
                 streams: list[Any]) -> tuple[tuple[TensorSpec, ...], int]:
        """Run every warm-up batch on each stream; the outputs' signature, and the bytes of the largest warm-up
        batch's inputs and outputs."""
        outputs: tuple[TensorSpec, ...] = ()
        largest = 0
        for stream in streams:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for batch, shapes in itertools.product(warmup_sizes(config), warmup_shapes(config)):
                    outputs = self._run_zeros(model, config, batch, shapes, f"warm-up of {name} {version} at "
                                                                            f"batch {batch}")
                    sizes = [*((spec.dtype, shape) for spec, shape in zip(config.inputs, shapes)),
                             *((spec.dtype, spec.shape) for spec in outputs)]
                    largest = max(largest, sum(tensor_bytes(dtype, (batch, *shape)) for dtype, shape in sizes))
            if stream is not None:
                stream.synchronize()
        if config.variable:
            outputs = self._varying_dims(model, name, config, version, outputs)
        return outputs, largest

    def _varying_dims(self, model: Loaded, name: str, config: ModelConfig, version: str,
                      at_bound: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        """The outputs' signature with the dims whose size follows the inputs' marked: those that differ
        between one sample at max_shape (the warm-up) and one with every -1 dim at 1."""
        least = [tuple(1 if dim == -1 else dim for dim in spec.shape) for spec in config.inputs]
        smallest = self._run_zeros(model, config, 1, least, f"warm-up of {name} {version} with every -1 dim at 1")
        if [len(s.shape) for s in smallest] != [len(s.shape) for s in at_bound]:
            raise ModelError(f"{name} {version} returns outputs of other ranks for inputs of other sizes")
        return tuple(TensorSpec(big.dtype, big.shape, tuple(dim for dim, (size, least) in
                                                            enumerate(zip(big.shape, small.shape)) if size != least))
                     for big, small in zip(at_bound, smallest))

    def _capture_graphs(self, model: Loaded, config: ModelConfig, what: str) -> int:
        """Capture each executor's graphs of `model` (if it has any) at each batch bucket; the bytes the
        device's allocator reserved for them. Each executor's pool keeps what its largest capture needed
        while the graphs live, which the peak of allocated memory alone does not show."""
        if not model.graphs:
            return 0
        on_gpu = self.device.type == "cuda"  # elsewhere only the tests' stand-in captures
        reserved = torch.cuda.memory_reserved(self.device) if on_gpu else 0
        for graphs in model.graphs:
            for batch, shapes in itertools.product(config.batch_buckets, warmup_shapes(config)):
                self._capture_at(graphs, model, config, batch, shapes, what)
        return torch.cuda.memory_reserved(self.device) - reserved if on_gpu else 0

    def _capture_at(self, graphs: Graphs, model: Loaded, config: ModelConfig, batch: int,
                 shapes: Sequence[tuple[int, ...]], what: str) -> None:
        """Capture `model` at `batch` samples of `shapes`, or ModelError saying why it cannot be."""
        try:
            graphs.capture(model.forward, self._zeros(config, batch, shapes))
        except Exception as exc:  # noqa: BLE001 - a model may do what a graph cannot hold
            raise ModelError(f"capturing a CUDA graph of {what} at batch {batch} failed: {describe_error(exc)}; "
                             "set cuda_graphs = false for this model") from None

    def _zeros(self, config: ModelConfig, batch: int, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        return [torch.zeros((batch, *shape), dtype=TORCH_DTYPES[spec.dtype], device=self.device)
                for spec, shape in zip(config.inputs, shapes)]

    def _run_zeros(self, model: Loaded, config: ModelConfig, batch: int, shapes: Sequence[tuple[int, ...]],
                   what: str) -> tuple[TensorSpec, ...]:
        """Run `model` on zeros of `batch` samples of `shapes` (one per input); the outputs' signature, or
        ModelError saying `what` failed."""
        return self.signature(self._run(model, self._zeros(config, batch, shapes), what))

    @staticmethod
    def _run(model: Loaded, inputs: list[torch.Tensor], what: str) -> tuple[torch.Tensor, ...]:
        """Run `model` on `inputs`; its outputs, or ModelError saying `what` failed."""
        try:
            return model(inputs)
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model may raise anything
            raise ModelError(f"{what} failed: {describe_error(exc)}") from None

    def _check_room(self, name: str, version: str, path: Path, factor: float) -> None:
        """The memory guard: refuse to load unless the device has `factor` x the file's size free."""
        size = path.stat().st_size
        need = int(size * factor)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            where = str(self.device)
        else:
            free = psutil.virtual_memory().available
            where = "host memory"
        if free < need:
            raise ModelError(
                f"{where} has {free / 2**20:.0f} MiB free, but {name} {version} ({size / 2**20:.1f} MiB on disk) "
                f"needs {need / 2**20:.0f} MiB beside the live version (workers.reload_memory_factor = {factor:g})"
            )

    def _check_canary(self, model: Loaded, name: str, version: str, folder: Path) -> None:
        """If the version folder holds an example input and its expected output, reproduce it."""
        example, expected = folder / CANARY_INPUT, folder / CANARY_OUTPUT
        if not (example.exists() and expected.exists()):
            return
        try:
            x = np.load(example, allow_pickle=False)
            want = np.load(expected, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the canary of {name} {version}: {exc}") from None
        # .npy files hold no bfloat16 (np.save writes it as raw V2), so the input is never one;
        # an output may be, and compares with a float expected output as any float does.
        got = to_numpy(model([torch.from_numpy(x).to(self.device)])[0].cpu())
        if got.shape != want.shape or not np.allclose(got, want, rtol=CANARY_RTOL, atol=CANARY_ATOL):
            raise ModelError(
                f"{name} {version} does not reproduce {CANARY_OUTPUT}: its output differs by up to "
                f"{_max_difference(got, want)} (rtol {CANARY_RTOL:g}, atol {CANARY_ATOL:g})"
            )

    def _check_padding(self, model: Loaded, name: str, config: ModelConfig, version: str,
                       outputs: tuple[TensorSpec, ...], folder: Path) -> None:
        """Where the inputs are padded, a sample padded must be answered as at its own size (padding_check):
        else ModelError saying that padding changes the version's answer, and what to do."""
        what = f"the padding check of {name} {version}"

        def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
            return [to_numpy(y.cpu()) for y in self._run(model, [from_numpy(x).to(self.device) for x in inputs], what)]

        problem = padding_check.check(name, version, config, outputs, folder / CANARY_INPUT, run)
        if problem is not None:
            raise ModelError(problem)


def _compile_counts() -> tuple[int, int]:
    """Inductor's graphs compiled and graphs found in its cache so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]


def _describe(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{s.dtype} [N, {', '.join(map(str, s.shape))}]".replace(", ]", "]") for s in specs)


def _max_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)} instead of {list(want.shape)}"
    return f"{float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))):.3g}"
