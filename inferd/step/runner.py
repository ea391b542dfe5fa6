"""Python models in a step process: model.py imported, its Model made once, run on numpy arrays.

A version folder holding model.py is a Python model. It defines a class `Model`, constructed once per process as
`Model()` or `Model(context)` (a ModelContext) and called as `model(inputs)`, a dict from input name to a numpy
array whose first dim is the batch; it answers a dict from output name to an array with the same first dim, in
the dtype (or one that casts to it) and per-sample shape its config declares. An optional `close()` is called
when the version is unloaded. What it answers is checked here, so that a mistake in it is a sentence naming
the output rather than a wrong reply.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.compute.executor import exception_text
from inferd.config.schema import CANARY_ATOL, CANARY_RTOL, ModelConfig, OutputSpec
from inferd.ipc import messages
from inferd.ipc.messages import LoadedModel, TensorSpec
from inferd.models.repository import is_python, model_file, writable_by_others
from inferd.protocol import BYTES, DTYPES
from inferd.worker import padding_check

log = logging.getLogger("inferd.step.runner")

CANARY_INPUT, CANARY_OUTPUT = "example_input.npy", "expected_output.npy"
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ModelError(Exception):
    """A Python model cannot be loaded, or answered what its config does not declare; the message says how."""


@dataclass(frozen=True)
class ModelContext:
    """What a Python model's constructor is handed (`Model(context)`): its version's folder, its name and version,
    and its config's `parameters` table."""

    version_dir: Path
    name: str
    version: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Output:
    """One output a Python model must answer: its name, dtype name, per-sample shape (-1: any size up to
    `bound`)."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    bound: tuple[int, ...]

    @classmethod
    def declared(cls, index: int, spec: OutputSpec) -> Output:
        """The output as its config declares it (kind_problem made sure it does)."""
        assert spec.dtype is not None and spec.shape is not None
        return cls(spec.name or f"OUTPUT__{index}", spec.dtype, spec.shape, spec.bound)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of its array: of a BYTES output, object (each element `bytes` or `str`)."""
        return np.dtype(object) if self.dtype_name == BYTES else DTYPES[self.dtype_name]

    def checked(self, value: Any, rows: int) -> np.ndarray:
        """`value` as this output's array of `rows` samples: cast to its dtype where numpy casts it so (float64
        to float32, say; of a BYTES output, a list or array of str or bytes), C-contiguous; ModelError saying how
        it differs otherwise."""
        array = self._strings(value) if self.dtype_name == BYTES else np.asarray(value)
        if array.dtype != self.dtype:
            if not np.can_cast(array.dtype, self.dtype, "same_kind"):
                raise ModelError(f"output {self.name!r} is {array.dtype}, which does not cast to the "
                                 f"{self.dtype.name} its config declares")
            array = self._cast(array)
        shape = list(array.shape)
        fits = len(shape) == len(self.shape) + 1 and shape[0] == rows and all(
            size == dim if dim != -1 else size <= most for size, dim, most in zip(shape[1:], self.shape, self.bound))
        if not fits:
            per_sample = ", ".join("-1" if dim == -1 else str(dim) for dim in self.shape)
            raise ModelError(f"output {self.name!r} has shape {shape}, but the batch has {rows} samples and its config "
                             f"declares [N{', ' if per_sample else ''}{per_sample}]"
                             + (f" (each -1 at most max_shape {list(self.bound)})" if -1 in self.shape else ""))
        return np.ascontiguousarray(array)

    def _cast(self, array: np.ndarray) -> np.ndarray:
        """`array` cast to this output's dtype; ModelError where a value does not survive it (an integer out of
        the dtype's range would wrap, a float out of its range become an infinity): a wrong answer, silently."""
        with np.errstate(over="ignore", invalid="ignore"):  # what overflows is refused below
            cast = array.astype(self.dtype)
        if self.dtype.kind in "iu" and array.size and array.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lost = array.min() < info.min or array.max() > info.max
        elif self.dtype.kind == "f" and array.dtype.kind == "f":
            lost = bool((np.isinf(cast) & np.isfinite(array)).any())
        else:
            lost = False
        if lost:
            raise ModelError(f"output {self.name!r} is {array.dtype} with values that {self.dtype.name}, the dtype "
                             "its config declares, cannot hold; answer values in its range, or declare a wider dtype")
        return cast

    def spec(self) -> TensorSpec:
        """Its signature as the supervisor keeps it: at its largest, its -1 dims marked as varying."""
        return TensorSpec(self.dtype_name, self.bound, tuple(d for d, dim in enumerate(self.shape) if dim == -1))

    def _strings(self, value: Any) -> np.ndarray:
        """A BYTES output's value as an object array of `bytes` and `str` (each str goes out UTF-8)."""
        array = np.asarray(value, dtype=object) if isinstance(value, (list, tuple)) else np.asarray(value)
        if array.dtype.kind == "S":
            raise ModelError(f"output {self.name!r} is a fixed-width bytes array ({array.dtype}), which has cut the "
                             "trailing NUL bytes of its elements; answer an object array of bytes "
                             "(np.array(values, dtype=object)) or a list")
        if array.dtype.kind == "U":
            return array.astype(object)
        if array.dtype != object:
            raise ModelError(f"output {self.name!r} is {array.dtype}, but its config declares bytes; answer str or "
                             "bytes elements")
        none_found = object()  # not None, which is itself an element a model may answer
        strange = next((element for element in array.flat if not isinstance(element, (bytes, str))), none_found)
        if strange is not none_found:
            raise ModelError(f"output {self.name!r} is bytes, and holds a {type(strange).__name__}; each element "
                             "must be bytes or str")
        return array


class PythonModel:
    """One version of a Python model, made in this process: its instance, its inputs' and outputs' names."""

    def __init__(self, name: str, version: str, instance: Any, config: ModelConfig) -> None:
        self.name, self.version = name, version
        self.instance = instance
        self.input_names = config.input_names()
        self.outputs = [Output.declared(index, spec) for index, spec in enumerate(config.outputs)]

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run the model on a batch (one array per input, in the config's order); its outputs, checked, in the
        config's order."""
        result = self.instance(dict(zip(self.input_names, inputs)))
        if not isinstance(result, Mapping):
            raise ModelError(f"the model returned {type(result).__name__}; return a dict from output name to array")
        names = [output.name for output in self.outputs]
        missing = [name for name in names if name not in result]
        extra = [name for name in result if name not in names]
        if missing or extra:
            raise ModelError(f"the model returned the outputs {sorted(map(str, result))}, but its config lists "
                             f"{names}")
        rows = len(inputs[0])
        return [output.checked(result[output.name], rows) for output in self.outputs]

    def close(self) -> None:
        """Call the model's own close(), if it has one; what it raises is logged, never raised."""
        close = getattr(self.instance, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - a model may raise anything; its unload goes on
                log.error("%s %s: close() raised %s", self.name, self.version, exception_text(exc))


class PythonRunner:
    """The versions of Python models loaded in this process, by name and version (inferd.compute.process.Runner)."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], PythonModel] = {}

    def get(self, name: str, version: str) -> PythonModel:
        """A loaded version; ModelError where it is not loaded here."""
        model = self._models.get((name, version))
        if model is None:
            raise ModelError(f"{name} {version} is not loaded in this process")
        return model

    def load(self, name: str, config: ModelConfig, version: str,
             expect: tuple[TensorSpec, ...] | None = None) -> tuple[LoadedModel, float, float]:
        """Import model.py of `version`, make its Model, and warm it on its example input if its folder has one
        (which must then reproduce its expected output, if it has one); its signature and the seconds each
        took. With `expect`, its outputs must have that signature. Whatever fails, nothing of it stays loaded."""
        started = time.perf_counter()
        memory_before = _resident()
        path = model_file(config.repository or "", version)
        if not is_python(path):
            raise ModelError(f"{name} {version} is a tensor model ({path.name}), which runs on a worker, not in a "
                             "Python model's process: a model keeps its kind across versions")
        refusal = None if config.allow_writable else writable_by_others(name, path)
        if refusal is not None:
            raise ModelError(refusal)
        model = PythonModel(name, version, _construct(name, version, path, config), config)
        try:
            loaded = time.perf_counter()
            outputs = tuple(output.spec() for output in model.outputs)
            if expect is not None and outputs != expect:
                raise ModelError(f"{name} {version} declares the outputs {_describe(outputs)}, but the live version "
                                 f"has {_describe(expect)} (allow it with --allow-signature-change)")
            self._warm_up(model, path.parent)
            self._check_padding(model, config, outputs, path.parent)
        except BaseException:
            model.close()
            _forget_module(name, version)
            raise
        self._models[(name, version)] = model
        warmed = time.perf_counter()
        log.info("loaded %s %s from %s in %.2f s, warmed in %.2f s", name, version, path, loaded - started,
                 warmed - loaded)
        memory = max(0, _resident() - memory_before)
        return LoadedModel(version=version, outputs=outputs, memory=memory), loaded - started, warmed - loaded

    def load_version(self, message: messages.LoadVersion) -> tuple[LoadedModel, float, float]:
        """Load a version the supervisor asks for (a reload, a canary, a catch-up)."""
        return self.load(message.model, message.config, message.version, message.expect)

    def unload(self, name: str, version: str) -> None:
        """Close and forget a version."""
        model = self._models.pop((name, version), None)
        if model is None:
            return
        model.close()
        _forget_module(name, version)
        self.release_memory()
        log.info("unloaded %s %s", name, version)

    def close(self) -> None:
        """Close every version (the process stops)."""
        for name, version in list(self._models):
            self.unload(name, version)

    def release_memory(self) -> None:
        """Collect what no longer has an owner (what a failed load left)."""
        gc.collect()

    def idle(self, control: Any, executors: Any) -> None:
        """Nothing to do between messages: a step holds no device memory."""

    def trim(self, control: Any) -> None:
        """Nothing to trim: a step holds no device memory."""
        log.info("asked to trim: nothing to return in a Python model's process")

    def _warm_up(self, model: PythonModel, folder: Path) -> None:
        """Run the model once on its folder's example input, if it has one (a model of one input), and compare
        with its expected output, if it has one."""
        example, expected = folder / CANARY_INPUT, folder / CANARY_OUTPUT
        if not example.exists() or len(model.input_names) != 1:
            return
        what = f"{model.name} {model.version}"
        try:
            x = np.load(example, allow_pickle=False)
            want = np.load(expected, allow_pickle=False) if expected.exists() else None
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the example input or expected output of {what}: {exc}") from None
        try:
            got = model([x])[0]
        except ModelError as exc:
            raise ModelError(f"{what}, run on {CANARY_INPUT}: {exc}") from None
        except BaseException as exc:  # noqa: BLE001 - a model may raise anything, sys.exit() too
            raise ModelError(f"{what} raised on {CANARY_INPUT}: {exception_text(exc)}") from None
        if want is not None and (got.shape != want.shape or not np.allclose(got, want, rtol=CANARY_RTOL,
                                                                             atol=CANARY_ATOL)):
            raise ModelError(f"{what} does not reproduce {CANARY_OUTPUT} (rtol {CANARY_RTOL:g}, atol {CANARY_ATOL:g})")

    @staticmethod
    def _check_padding(model: PythonModel, config: ModelConfig, outputs: tuple[TensorSpec, ...],
                       folder: Path) -> None:
        """Where its inputs are padded, a sample padded must be answered as at its own size, as a tensor model's
        must (padding_check): else ModelError saying that padding changes the version's answer."""
        what = f"the padding check of {model.name} {model.version}"

        def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
            try:
                return model(inputs)
            except ModelError as exc:
                raise ModelError(f"{what}: {exc}") from None
            except BaseException as exc:  # noqa: BLE001 - a model may raise anything, sys.exit() too
                raise ModelError(f"{what} failed: {exception_text(exc)}") from None

        problem = padding_check.check(model.name, model.version, config, outputs, folder / CANARY_INPUT, run)
        if problem is not None:
            raise ModelError(problem)


def _module_name(name: str, version: str) -> str:
    """The name model.py of `version` is imported under: its own per version, so two versions live side by side."""
    return re.sub(r"\W", "_", f"inferd_model_{name}_{version}")


def _forget_module(name: str, version: str) -> None:
    sys.modules.pop(_module_name(name, version), None)


def _construct(name: str, version: str, path: Path, config: ModelConfig) -> Any:
    """Import model.py at `path` and make its Model: `Model(context)` where its constructor takes an argument,
    else `Model()`; ModelError saying what went wrong."""
    what = f"{name} {version}"
    module_name = _module_name(name, version)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"{path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # what the module defines (dataclasses, say) looks itself up there
    try:
        try:
            spec.loader.exec_module(module)
        # Not only Exception: a sys.exit() in model code would end the process, saying only its exit code.
        except BaseException as exc:  # noqa: BLE001 - model code may raise anything
            raise ModelError(f"importing {path} raised {exception_text(exc)}") from None
        cls = getattr(module, "Model", None)
        if not inspect.isclass(cls):
            raise ModelError(f"{path} defines no class Model; a Python model is a class Model whose instances are "
                             "called with a dict of input arrays")
        context = ModelContext(path.parent, name, version, dict(config.parameters))
        try:
            make: Any = cls  # a class of the model's, whose constructor takes the context or nothing
            instance = make(context) if _takes_an_argument(cls) else make()
        except BaseException as exc:  # noqa: BLE001 - model code may raise anything, sys.exit() too
            raise ModelError(f"{what}: Model() raised {exception_text(exc)}") from None
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    if not callable(instance):
        sys.modules.pop(module_name, None)
        raise ModelError(f"{what}: a Model cannot be called; give it __call__(self, inputs)")
    return instance


def _takes_an_argument(cls: type) -> bool:
    """Whether constructing `cls` takes a positional argument (the context)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def _resident() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE


def _describe(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{spec.dtype} {spec.public_shape()}" for spec in specs)
