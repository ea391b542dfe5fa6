"""`inferd convert`: a version of a model made again in another format, beside it in its repository.

TorchScript goes through PyTorch's converter (TS2EPConverter) to a torch.export
program; a program is exported again with a dynamic batch dim up to the model's
max_batch_size (and, for inputs of any size, a dynamic dim up to max_shape for
each -1, one per position, shared by the inputs that have it there: they are
padded alike), and with the `aoti` format compiled by AOTInductor for the
device. The new version must give the old one's answers, on seeded inputs at
several batch sizes (and sizes of the -1 dims) and on the folder's example_input.npy; its folder gets an
example input and the old version's output for it (expected_output.npy), which
the reload guard checks again when it loads the version. Nothing is written to
the repository unless every step passed: the version appears whole or not at
all. This runs in the command's own process, never in the daemon's.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.compute.executor import describe_error
from inferd.config.schema import CANARY_ATOL, CANARY_RTOL, ModelConfig, version_problem
from inferd.models import model_files
from inferd.models.repository import RepositoryError, model_file, writable_by_others
from inferd.worker.runner import TORCH_DTYPES, as_outputs

SEED = 0
EXAMPLE_LENGTH = 5  # what a -1 dim is in the examples that trace the program (not 1: export specializes it)
UNSUPPORTED_NODE = re.compile(r"^\s*\d+\.\s+(\S+)\s+\[", re.MULTILINE)  # a line of TS2EPConverter.explain()


class ConvertError(Exception):
    """A conversion that cannot be done; the message says why in one sentence."""


def default_format() -> str:
    """`aoti` where a C++ compiler is found (AOTInductor needs one), else `exported`."""
    return model_files.AOTI if shutil.which("c++") or shutil.which("g++") else model_files.EXPORTED


def convert(name: str, model: ModelConfig, source: str, target: str, format_: str, device: str,
            say: Callable[[str], None]) -> Path:
    """Make version `target` of model `name` from version `source` in `format_` for `device`, checked against
    `source`; `say` hears each step as it starts. Returns the new version's folder; ConvertError otherwise."""
    repository = Path(model.repository or "")
    problem = version_problem(target)
    if problem is not None:
        raise ConvertError(f"--to {problem}")
    destination = repository / target
    if destination.exists():
        raise ConvertError(f"{destination} exists already; name another version with --to")
    try:
        path = model_file(repository, source)
    except RepositoryError as exc:
        raise ConvertError(str(exc)) from None
    found = model_files.inspect(path)
    if found.problem is not None:
        raise ConvertError(found.problem)
    if found.format == model_files.AOTI:
        raise ConvertError(f"{path} is an AOTInductor package already; convert the version it was made from")
    if found.format == model_files.PYTHON:
        raise ConvertError(f"{path} is a Python model, which runs as it is: there is nothing to convert")
    target_device = _device(device)
    examples = _seeded_inputs(model, 2, target_device, length=EXAMPLE_LENGTH)
    say(f"loading {name} {source} ({found.format}) from {path}")
    original = _load(path, found.format, target_device)
    module = original
    if found.format == model_files.TORCHSCRIPT:
        say("converting TorchScript to a torch.export program (PyTorch's TS2EPConverter)")
        module = _from_torchscript(name, source, original, examples)
    varying = " and a dynamic dim for each -1 (up to max_shape)" if model.variable else ""
    say(f"exporting with a dynamic batch dim of 1 to {model.max_batch_size}{varying}")
    program = _export(name, source, module, examples, model)
    with tempfile.TemporaryDirectory(prefix=f".{target}-", dir=repository) as staging:
        folder = Path(staging) / target
        folder.mkdir()
        package = folder / "model.pt2"
        if format_ == model_files.AOTI:
            say(f"compiling with AOTInductor for {target_device} (minutes on a small machine)")
            converted = _compile(program, package, target_device)
        else:
            say(f"saving the program as {package.name}")
            torch.export.save(program, str(package))
            converted = torch.export.load(str(package)).module()
        sizes = sorted({1, 2, model.max_batch_size})
        lengths = _lengths(model)
        say(f"checking {target} against {source} at batch sizes {', '.join(map(str, sizes))}"
            + (f" and -1 dims of {', '.join(map(str, lengths))}" if model.variable else ""))
        example = _check(original, converted, model, source, target, sizes, lengths, path.parent, target_device)
        if example is not None:
            x, expected = example
            np.save(folder / "example_input.npy", x)
            np.save(folder / "expected_output.npy", expected)
        for written in folder.iterdir():
            written.chmod(0o644)
        folder.chmod(0o755)
        folder.rename(destination)
    problem = writable_by_others(name, destination / "model.pt2")
    if problem is not None and not model.allow_writable:
        say(f"note: {problem}")
    return destination


def _device(name: str) -> torch.device:
    """The device --device names, where this machine has it; ConvertError otherwise (torch would raise a
    RuntimeError for a bad name, and an AssertionError for CUDA on a build without it, at first use)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConvertError(f"--device {name!r} is not a device; say cpu or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConvertError(f"--device {name!r} is not a device inferd serves on; say cpu or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ConvertError(f"--device {name}: this machine has no CUDA device that torch can use; say cpu")
    if device.index is not None and device.index >= count:
        raise ConvertError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _seeded_inputs(model: ModelConfig, batch: int, device: torch.device, seed: int = SEED,
                   length: int = 1) -> tuple[torch.Tensor, ...]:
    """Inputs of `batch` samples, each -1 dim `length` long (at most its bound), drawn from `seed`: floats from
    a normal law, other dtypes 0 or 1 (ids in range of any embedding, and masks that mask)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for spec in model.inputs:
        dtype = TORCH_DTYPES[spec.dtype]
        shape = (batch, *(min(length, most) if dim == -1 else dim for dim, most in zip(spec.shape, spec.bound)))
        value = (torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
                 else torch.randint(0, 2, shape, generator=generator).to(dtype))
        inputs.append(value.to(device))
    return tuple(inputs)


def _load(path: Path, format_: str | None, device: torch.device) -> Any:
    try:
        if format_ == model_files.TORCHSCRIPT:
            return torch.jit.load(str(path), map_location=device).eval()
        return torch.export.load(str(path)).module().to(device)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a file it cannot read
        raise ConvertError(f"cannot load {path}: {describe_error(exc)}") from None


def _from_torchscript(name: str, source: str, module: Any, examples: tuple[torch.Tensor, ...]) -> Any:
    from torch._export.converter import TS2EPConverter

    try:
        return TS2EPConverter(module, examples).convert().module()
    except Exception as exc:  # noqa: BLE001 - the converter names what stopped it in its explanation
        try:
            explained = TS2EPConverter(module, examples).explain() or ""
        except Exception:  # noqa: BLE001 - explain itself may fail where convert did
            explained = ""
        ops = list(dict.fromkeys(UNSUPPORTED_NODE.findall(explained)))
        blocked = (f"PyTorch's converter does not support {', '.join(ops)}" if ops else
                   f"PyTorch's converter failed: {describe_error(exc)}")
        raise ConvertError(f"{name} {source} cannot be converted from TorchScript: {blocked}; export the model from "
                           "its Python source with torch.export.export instead") from None


def _lengths(model: ModelConfig) -> list[int]:
    """The sizes the -1 dims are checked at: 1, the example's and the longest bound ([1] without -1 dims)."""
    if not model.variable:
        return [1]
    longest = max(most for spec in model.inputs for dim, most in zip(spec.shape, spec.bound) if dim == -1)
    return sorted({1, min(EXAMPLE_LENGTH, longest), longest})


def _export(name: str, source: str, module: Any, examples: tuple[torch.Tensor, ...], model: ModelConfig) -> Any:
    batch = torch.export.Dim("batch", min=1, max=max(2, model.max_batch_size))
    # One Dim per position of a -1, as long as the longest bound there, for every input with a -1 there.
    longest: dict[int, int] = {}
    for spec in model.inputs:
        for position, (dim, most) in enumerate(zip(spec.shape, spec.bound), start=1):
            if dim == -1:
                longest[position] = max(longest.get(position, 0), most)
    dims = {position: torch.export.Dim(f"dim{position}", min=1, max=most)
            for position, most in longest.items() if most >= 2}
    dynamic = tuple({0: batch, **{position: dims[position] for position, dim in enumerate(spec.shape, start=1)
                                  if dim == -1 and position in dims}} for spec in model.inputs)
    try:
        return torch.export.export(module, examples, dynamic_shapes=dynamic)
    except Exception as exc:  # noqa: BLE001 - export's errors name the op or the guard that stopped it
        what = "a dynamic batch dim and dynamic -1 dims" if dims else "a dynamic batch dim"
        raise ConvertError(f"{name} {source} cannot be exported with {what}: {describe_error(exc)}") from None


def _compile(program: Any, package: Path, device: torch.device) -> Any:
    from torch._inductor.package import load_package

    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    except Exception as exc:  # noqa: BLE001 - a compiler's failure, in one line
        raise ConvertError(f"AOTInductor could not compile it: {describe_error(exc)}") from None
    return load_package(str(package), device_index=device.index if device.index is not None else -1)


def _outputs(module: Any, inputs: Sequence[torch.Tensor]) -> tuple[np.ndarray, ...]:
    with torch.inference_mode():
        return tuple(y.detach().float().cpu().numpy() if y.is_floating_point() else y.detach().cpu().numpy()
                     for y in as_outputs(module(*inputs)))


def _check(original: Any, converted: Any, model: ModelConfig, source: str, target: str, sizes: list[int],
           lengths: list[int], folder: Path, device: torch.device) -> tuple[np.ndarray, np.ndarray] | None:
    """Compare `converted` with `original` on seeded inputs of each batch size (with each of `lengths` for the -1
    dims) and the folder's example input; the example input and `original`'s output for it (the canary of the
    new version: one input models only)."""
    cases = [(f"batch {size}" + (f", -1 dims of {length}" if model.variable else ""),
              _seeded_inputs(model, size, device, SEED + size, length)) for size in sizes for length in lengths]
    example = folder / "example_input.npy"
    if example.exists():
        cases.append((example.name, (torch.from_numpy(np.load(example, allow_pickle=False)).to(device),)))
    for label, inputs in cases:
        want, got = _outputs(original, inputs), _outputs(converted, inputs)
        for index, (a, b) in enumerate(zip(want, got)):
            if a.shape != b.shape or not np.allclose(b, a, rtol=CANARY_RTOL, atol=CANARY_ATOL):
                by = (f"shape {list(b.shape)} instead of {list(a.shape)}" if a.shape != b.shape else
                      f"up to {float(np.max(np.abs(b.astype(np.float64) - a.astype(np.float64)))):.3g}")
                raise ConvertError(f"{target} does not give {source}'s answers on {label}: output {index} differs "
                                   f"by {by} (rtol {CANARY_RTOL:g}, atol {CANARY_ATOL:g})")
    if len(model.inputs) != 1:
        return None
    inputs = cases[-1][1] if example.exists() else cases[len(lengths)][1]
    return inputs[0].cpu().numpy(), _outputs(original, inputs)[0]


def timed(say: Callable[[str], None]) -> Callable[[str], None]:
    """`say` with each line prefixed by the seconds since this call, as `inferctl reload` shows its steps."""
    started = time.perf_counter()
    return lambda line: say(f"[{time.perf_counter() - started:7.2f} s] {line}")
