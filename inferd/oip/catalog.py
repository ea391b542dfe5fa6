"""What the gateway knows of each model: its tensors by name, its live version and readiness, and how
a request of the protocol becomes inferd's request, and inferd's reply the protocol's response."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from inferd import protocol
from inferd.config.schema import ModelConfig
from inferd.errors import InvalidRequest, quoted
from inferd.oip import tensors
from inferd.oip.shm import EXTENSION, InRegion
from inferd.oip.upstream import Control
from inferd.protocol import Buffer

# What server metadata says is served, in both protocols (client shared memory where it is on).
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "statistics", "parameters")
# What either protocol answers when the gateway itself raised.
GATEWAY_BUG = "the gateway failed on this request (a bug; its traceback is in the daemon's log)"
FRESH_S = 1.0  # how long a model's state read from the supervisor is taken as current


def server_extensions(shared_memory: bool) -> list[str]:
    """The extensions server metadata names, `shared_memory`: whether this front end's clients may register regions."""
    return [*EXTENSIONS, EXTENSION] if shared_memory else list(EXTENSIONS)


class NotFound(Exception):
    """No such model, or not that version of it; the message says which."""


class Refused(Exception):
    """The daemon refused a model repository command (load, unload); the message says why."""


def output_name(model: ModelConfig, index: int) -> str:
    """Output `index`'s protocol name: the configured one, else OUTPUT__<index>."""
    return model.output_name(index)


class GivenInput(NamedTuple):
    """One input of a request as its protocol gave it: raw little-endian bytes, its values (gRPC's typed
    contents), the JSON text of its values, or where in the client's shared-memory region it lies."""

    name: Any
    datatype: Any
    shape: Any
    raw: Buffer | None
    values: Any = None
    region: InRegion | None = None
    json: Buffer | None = None


class Requested(NamedTuple):
    """A checked request: its inputs in the model's order as (metadata, bytes or None for one in a region),
    its deadline, its priority as inferd's level (None: queue.default_priority)."""

    inputs: list[tuple[protocol.TensorMeta, Buffer | None]]
    timeout_ms: int | None
    level: int | None = None

    @property
    def samples(self) -> int:
        """The request's batch dim."""
        return self.inputs[0][0].shape[0]

    @property
    def in_regions(self) -> bool:
        """Whether an input lies in a client's shared-memory region."""
        return any(data is None for _, data in self.inputs)


def timeout_ms(timeout: Any) -> int:
    """The protocol's `timeout` parameter (microseconds) as inferd's deadline in milliseconds."""
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise InvalidRequest("parameters.timeout must be a positive number of microseconds")
    return max(1, math.ceil(timeout / 1000))


def priority_level(priority: Any, levels: int) -> int | None:
    """The protocol's `priority` parameter as inferd's priority level, None for the default, for a daemon
    of `levels` levels.

    Triton's convention, which its clients follow: 0 (or none) is the default level, 1 the most urgent,
    and N is inferd's level N - 1 (inferd's levels start at 0, the most urgent). tritonclient sends
    `priority=` only when it is not 0 (an int in the HTTP JSON, a uint64_param over gRPC), so passing the
    number through unchanged would leave its users no way to reach level 0, and with the default two
    levels none to rise above the default. The levels are the supervisor's as last read (FRESH_S): a
    request sent just after a SIGHUP took levels away is refused by the supervisor, in its numbers."""
    if priority is None:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise InvalidRequest(f"parameters.priority must be a whole number, 0 (the default) or 1 (the most "
                             f"urgent) and up; got {quoted(priority)}")
    if priority > levels:
        raise InvalidRequest(f"parameters.priority {quoted(priority)} is not a level; this daemon takes 1 (the most "
                             f"urgent) to {levels}, or 0 for its default")
    return None if priority == 0 else priority - 1


# By what the supervisor says a model is ("kind"): Triton's platform and backend for it.
PLATFORMS = {"tensor": ("pytorch_libtorch", "pytorch"), "python": ("python", "python"), "pipeline": ("ensemble", "")}


class ModelView:
    """One model as the protocol sees it."""

    def __init__(self, name: str, state: dict[str, Any], streams: int, devices: list[str]) -> None:
        """`state`: the supervisor's `models` answer for this model."""
        self.name = name
        self.config = msgspec.convert(state["config"], ModelConfig)
        self.priority_levels: int = state["priority_levels"]
        self.default_level: int = state["default_level"]
        self.version: str = state["live_version"]
        self.canary: str | None = state.get("canary_version")  # may be named too while it runs
        self.pipeline = state["kind"] == "pipeline"  # a pipeline: its version is its steps' versions
        self.ready: bool = state["ready"]
        # Triton's names for what runs a model: its ensembles, its Python backend, or its PyTorch one.
        self.platform, self.backend = PLATFORMS[state["kind"]]
        self.numbers: dict[str, int] = state["version_numbers"]
        self.outputs: list[tuple[str, list[int]]] = [(dtype, list(shape)) for dtype, shape in state["outputs"]]
        self.inputs = self.config.input_names()
        self.output_names = [output_name(self.config, i) for i in range(len(self.outputs))]
        self._streams = streams
        self._devices = devices

    def named(self, version: str | None) -> str | None:
        """A version as the request gave it, by name or by number, as its name (a name wins)."""
        if version is None or version in self.numbers or not version.isdigit():
            return version
        return next((name for name, number in self.numbers.items() if number == int(version)), version)

    def number(self, version: str) -> str:
        """A version's number as the protocol's version string; its name if it has none."""
        number = self.numbers.get(version)
        return version if number is None else str(number)

    def metadata(self) -> dict[str, Any]:
        """The model metadata response."""
        return {
            "name": self.name, "versions": [self.version, *([self.canary] if self.canary else [])],
            "platform": self.platform,
            "inputs": [tensors.metadata(n, s.dtype, s.shape) for n, s in zip(self.inputs, self.config.inputs)],
            "outputs": [tensors.metadata(name, dtype, shape)
                        for name, (dtype, shape) in zip(self.output_names, self.outputs)],
        }

    def triton_config(self) -> dict[str, Any]:
        """The model configuration extension's answer: the Triton config perf_analyzer reads."""
        gpus = [int(d.split(":")[1]) for d in self._devices if d.startswith("cuda:")]
        config = {
            "name": self.name, "platform": self.platform, "backend": self.backend,
            "max_batch_size": self.config.max_batch_size,
            "input": [{"name": n, "data_type": tensors.TRITON_TYPES[s.dtype], "dims": list(s.shape)}
                      for n, s in zip(self.inputs, self.config.inputs)],
            "output": [{"name": name, "data_type": tensors.TRITON_TYPES[dtype], "dims": shape}
                       for name, (dtype, shape) in zip(self.output_names, self.outputs)],
            "dynamic_batching": self._dynamic_batching(),
            "instance_group": [{"kind": "KIND_GPU", "count": self._streams, "gpus": gpus}] if gpus
            else [{"kind": "KIND_CPU", "count": self._streams * max(1, len(self._devices))}],
        }
        if self.config.max_wait_ms == "auto":
            # Triton's window is a fixed delay; the "auto" window has none to give, so it names itself
            # in the model's parameters.
            config["parameters"] = {"max_wait_ms": {"string_value": "auto"}}
        return config

    def _dynamic_batching(self) -> dict[str, Any]:
        """Triton's dynamic_batching block: a fixed window as its queue delay (the "auto" window says 0),
        and the priority levels in Triton's numbers, which `parameters.priority` takes (priority_level):
        inferd's levels 0 to priority_levels - 1 are Triton's 1 to priority_levels, and its default level
        is default_priority + 1."""
        wait = self.config.max_wait_ms
        return {"max_queue_delay_microseconds": 0 if wait == "auto" else int(wait * 1000),
                "priority_levels": self.priority_levels,
                "default_priority_level": self.default_level + 1}

    def request(self, given: Sequence[GivenInput], timeout: Any = None, priority: Any = None) -> Requested:
        """Check a request's inputs, deadline and priority against the model and take each input's bytes
        (InvalidRequest if wrong)."""
        if not given:
            raise InvalidRequest(f"the request has no inputs; {self.name} takes {', '.join(self.inputs)}")
        by_name: dict[str, tuple[protocol.TensorMeta, Buffer | None]] = {}
        for entry in given:
            if not isinstance(entry.name, str):
                raise InvalidRequest("each input is an object with a name")
            what = f"input {quoted(entry.name)}"
            if entry.name not in self.inputs:
                raise InvalidRequest(f"{self.name} has no {what}; it takes {', '.join(self.inputs)}")
            if entry.name in by_name:
                raise InvalidRequest(f"{what} is given twice")
            spec = self.config.inputs[self.inputs.index(entry.name)]
            dtype = tensors.wire_dtype(entry.datatype, what)
            if dtype != spec.dtype:
                raise InvalidRequest(f"{what} is {tensors.WIRE_TO_DATATYPE[dtype]}, but {self.name} takes "
                                     f"{tensors.WIRE_TO_DATATYPE[spec.dtype]}")
            shape = tensors.check_shape(entry.shape, what)
            if entry.region is not None:
                tensors.check_size(entry.region.byte_size, dtype, shape, what, "bytes in shared_memory_byte_size")
                byte_size = entry.region.byte_size if dtype == protocol.BYTES else None  # its elements' size
                by_name[entry.name] = (protocol.TensorMeta(dtype, shape, entry.region.region, entry.region.offset,
                                                           byte_size), None)
                continue
            if entry.raw is not None:
                data = tensors.from_bytes(entry.raw, dtype, shape, what)
            elif entry.json is not None:
                data = tensors.from_json(entry.json, dtype, shape, what)
            else:
                data = tensors.from_values(entry.values, dtype, shape, what)
            by_name[entry.name] = (protocol.TensorMeta(dtype, shape), data)
        missing = [n for n in self.inputs if n not in by_name]
        if missing:
            raise InvalidRequest(f"the request lacks input {missing[0]!r}; {self.name} takes {', '.join(self.inputs)}")
        return Requested([by_name[n] for n in self.inputs], None if timeout is None else timeout_ms(timeout),
                         priority_level(priority, self.priority_levels))

    def output_bytes(self, samples: int) -> list[int | None] | None:
        """Each output's bytes for a request of `samples` samples, where the model fixes its shape (None where
        it follows the inputs' or is BYTES); None for a pipeline, whose tensors travel in its messages only."""
        return None if self.pipeline else [_fixed_bytes(dtype, shape, samples) for dtype, shape in self.outputs]

    def place(self, name: str, region: InRegion, samples: int) -> protocol.OutputPlace:
        """Where output `name` of a request of `samples` samples goes: InvalidRequest if it does not fit."""
        # An output whose size the model decides is written only if it fits the client's window, and comes
        # back in the reply's frames otherwise (shm.check_placed refuses it then).
        needed = _fixed_bytes(*self.outputs[self.output_names.index(name)], samples) or 0
        if region.byte_size < needed:
            raise InvalidRequest(f"output {name!r} is {needed} bytes, but its shared_memory_byte_size is "
                                 f"{quoted(region.byte_size)}")
        return protocol.OutputPlace(region.region, region.offset, region.byte_size)

    def check_output(self, name: Any, parameters: Mapping[str, Any]) -> str:
        """A requested output's name, if the model has it and it is asked for as itself."""
        if not isinstance(name, str):
            raise InvalidRequest("each requested output is an object with a name")
        if name not in self.output_names:
            raise InvalidRequest(f"{self.name} has no output {quoted(name)}; it has {', '.join(self.output_names)}")
        if "classification" in parameters:
            # Triton's classification extension answers an output's top classes as strings; the tensor
            # itself, answered instead, would be read as those.
            raise InvalidRequest(f"output {name!r} is asked for as classification (its top classes), which inferd "
                                 "does not do: ask for the output itself and take its top classes from it")
        return name


def _fixed_bytes(dtype: str, shape: Sequence[int], samples: int) -> int | None:
    """An output's bytes for `samples` samples, where its shape is fixed (None where it follows the inputs' or it
    is BYTES)."""
    return None if -1 in shape or dtype == protocol.BYTES else samples * protocol.tensor_bytes(dtype, shape)


class Catalog:
    """The models as the supervisor has them now, SIGHUP's changes included: each model asked for is read
    again once the supervisor's word on it is over FRESH_S old (one model at a time, so that a daemon of a
    thousand models does not list them all for each)."""

    def __init__(self, streams: int, devices: list[str], control: Control) -> None:
        self._streams = streams  # a worker setting, which a SIGHUP does not change
        self._devices = devices
        self._control = control
        self._views: dict[str, tuple[ModelView, float]] = {}  # model -> its view, and when it was read
        self._reading: dict[str, asyncio.Future[ModelView | None]] = {}  # reads under way: who asks, waits

    async def model(self, name: str, version: str | None) -> ModelView:
        """The model `name`, at `version` if one is named: NotFound unless it is the live one (or its canary)."""
        known = self._views.get(name)
        view = known[0] if known is not None and time.monotonic() - known[1] <= FRESH_S else await self._read(name)
        if view is None:
            # Triton's words, which its users and clients look for.
            raise NotFound(f"Request for unknown model: {quoted(name)} is not found; the model repository index "
                           "lists the models served")
        if view.named(version) not in (None, view.version, view.canary):
            raise NotFound(f"Request for unknown model: {quoted(name)} version {quoted(version)} is not found; the "
                           f"live version is {view.version!r} (number {view.number(view.version)})")
        return view

    async def _read(self, name: str) -> ModelView | None:
        """`name` as the supervisor has it now (None where it serves no such model); requests that ask
        while it is read take the same answer."""
        reading = self._reading.get(name)
        if reading is None:
            reading = self._reading[name] = asyncio.ensure_future(self._fetch(name))
            reading.add_done_callback(lambda done: self._read_done(name, done))
        return await asyncio.shield(reading)  # one asker's cancellation does not end the others' read

    def _read_done(self, name: str, done: asyncio.Future[ModelView | None]) -> None:
        del self._reading[name]
        if not done.cancelled():
            done.exception()  # marked retrieved: every asker may have gone (each that waits raises it itself)

    async def _fetch(self, name: str) -> ModelView | None:
        state = await self._control.call("models", model=name)
        if name not in state:
            self._views.pop(name, None)
            return None
        view = ModelView(name, state[name], self._streams, self._devices)
        self._views[name] = (view, time.monotonic())
        return view

    async def for_infer(self, name: str, version: str | None) -> ModelView:
        """`model`, for an inference request: an on-demand model never loaded yet is loaded first, so that its
        outputs are known (Refused says why it could not be)."""
        view = await self.model(name, version)
        if view.outputs or not view.config.on_demand:
            return view
        await self.load(name)
        return await self.model(name, version)

    async def index(self, ready_only: bool) -> list[dict[str, str]]:
        """The model repository extension's index: each model (only those ready, with `ready_only`), its live
        version's number, and Triton's state for it: READY, LOADING, or UNAVAILABLE with the reason."""
        models = await self._control.call("models")
        entries = []
        for name in sorted(models):
            state = models[name]
            live = state["live_version"]
            if state["ready"]:
                status, reason = "READY", ""
            elif state["loading"]:
                status, reason = "LOADING", ""
            else:
                status, reason = "UNAVAILABLE", state["load_error"] or "not loaded on any worker"
            if status == "READY" or not ready_only:
                entries.append({"name": name, "version": str(state["version_numbers"].get(live, live)),
                                "state": status, "reason": reason})
        return entries

    async def load(self, name: str) -> None:
        """Have a worker load `name` (the daemon reads its config again for a name it does not know); Refused
        says why it was not."""
        await self._control.call_long("load", Refused, model=name)
        self._views.pop(name, None)  # its readiness changed: the next question reads it again

    async def unload(self, name: str) -> None:
        """Unload on-demand `name` from every worker; Refused says why it was not."""
        await self._control.call_long("unload", Refused, model=name)
        self._views.pop(name, None)

    async def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        """The statistics extension's answer for model `name` (every model if None), at `version` (a name
        or a number) or each ready version, from the numbers `inferctl stats` keeps; a ready version
        that has answered nothing yet is there with zero counts, as Triton lists it."""
        models = await self._control.call("models")
        entries = []
        for model in sorted(models):
            if name not in (None, model):
                continue
            state = models[model]
            known = self._views.get(model)
            wanted = known[0].named(version) if known is not None else version
            numbers: dict[str, int] = state["version_numbers"]
            for served in sorted(state["ready_versions"], key=lambda v: numbers.get(v, 0)):
                if wanted in (None, served):
                    entries.append(_model_statistics(model, str(numbers.get(served, served)),
                                                     state["versions"].get(served)))
        return {"model_stats": entries}


def _spent(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": int(seconds * 1e9)}


def _model_statistics(name: str, version: str, numbers: dict[str, Any] | None) -> dict[str, Any]:
    """One version's statistics as Triton gives them: each `ok` request counted once in each of
    queue and the compute phases, with the time it spent there; each batch by the samples it computed."""
    if numbers is None:
        numbers = {"requests": {}, "samples": 0, "total_s": 0.0, "queue_s": 0.0,
                   "phases_s": [0.0, 0.0, 0.0], "computed": {}, "last_inference_s": 0.0}
    requests = numbers["requests"]
    ok = requests.get(protocol.OK, 0)
    failed = sum(n for status, n in requests.items() if status != protocol.OK)
    inputs_s, infer_s, outputs_s = numbers["phases_s"]
    return {
        "name": name, "version": version, "last_inference": int(numbers["last_inference_s"] * 1000),
        "inference_count": numbers["samples"],
        "execution_count": int(sum(sums[0] for sums in numbers["computed"].values())),
        "inference_stats": {
            "success": _spent(ok, numbers["total_s"]), "fail": _spent(failed, 0.0),
            "queue": _spent(ok, numbers["queue_s"]), "compute_input": _spent(ok, inputs_s),
            "compute_infer": _spent(ok, infer_s), "compute_output": _spent(ok, outputs_s),
        },
        "batch_stats": [{"batch_size": int(size), "compute_input": _spent(int(count), inputs),
                         "compute_infer": _spent(int(count), infer), "compute_output": _spent(int(count), outputs)}
                        for size, (count, inputs, infer, outputs)
                        in sorted(numbers["computed"].items(), key=lambda kv: int(kv[0]))],
    }
