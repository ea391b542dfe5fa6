"""What the gateway knows of each model: its tensors by name, its live version and readiness, and how
a request of the protocol becomes inferd's request, and inferd's reply the protocol's response."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from inferd import protocol
from inferd.config import Config, ModelConfig
from inferd.errors import InvalidRequest
from inferd.oip import tensors
from inferd.oip.upstream import Control
from inferd.protocol import Buffer, ReplyHeader

FRESH_S = 1.0  # how long the models' state read from the supervisor is taken as current
TRITON_TYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "int8": "TYPE_INT8", "int16": "TYPE_INT16",
                "int32": "TYPE_INT32", "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32",
                "float64": "TYPE_FP64"}


class NotFound(Exception):
    """No such model, or not that version of it; the message says which."""


def input_names(model: ModelConfig) -> list[str]:
    """Each input's protocol name: its configured name, else INPUT__<i>."""
    return [spec.name or f"INPUT__{i}" for i, spec in enumerate(model.inputs)]


def output_name(model: ModelConfig, index: int) -> str:
    """Output `index`'s protocol name: the configured one, else OUTPUT__<index>."""
    return model.outputs[index].name if index < len(model.outputs) else f"OUTPUT__{index}"


@dataclass
class Prepared:
    """A request of the protocol, checked and turned into inferd's: its inputs in the model's order."""

    inputs: list[tuple[str, tuple[int, ...], Buffer]]
    timeout_ms: int | None
    request_id: str | None
    outputs: dict[str, bool] | None  # requested output name -> as binary; None: all, `binary`
    binary: bool


def _parameters(entry: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{what} has parameters that are not an object")
    return parameters


class ModelView:
    """One model as the protocol sees it."""

    def __init__(self, name: str, config: ModelConfig, state: dict[str, Any], streams: int,
                 devices: list[str]) -> None:
        self.name = name
        self.config = config
        self.version: str = state["live_version"]
        self.ready: bool = state["ready"]
        self.outputs: list[tuple[str, list[int]]] = [(dtype, list(shape)) for dtype, shape in state["outputs"]]
        self.inputs = input_names(config)
        self._streams = streams
        self._devices = devices

    def metadata(self) -> dict[str, Any]:
        """The model metadata response."""
        return {
            "name": self.name, "versions": [self.version], "platform": "pytorch_libtorch",
            "inputs": [tensors.metadata(n, s.dtype, s.shape) for n, s in zip(self.inputs, self.config.inputs)],
            "outputs": [tensors.metadata(output_name(self.config, i), dtype, shape)
                        for i, (dtype, shape) in enumerate(self.outputs)],
        }

    def triton_config(self) -> dict[str, Any]:
        """The model configuration extension's answer: the Triton config perf_analyzer reads."""
        gpus = [int(d.split(":")[1]) for d in self._devices if d.startswith("cuda:")]
        return {
            "name": self.name, "platform": "pytorch_libtorch", "backend": "pytorch",
            "max_batch_size": self.config.max_batch_size,
            "input": [{"name": n, "data_type": TRITON_TYPES[s.dtype], "dims": list(s.shape)}
                      for n, s in zip(self.inputs, self.config.inputs)],
            "output": [{"name": output_name(self.config, i), "data_type": TRITON_TYPES[dtype], "dims": shape}
                       for i, (dtype, shape) in enumerate(self.outputs)],
            "dynamic_batching": {"max_queue_delay_microseconds": int(self.config.max_wait_ms * 1000)},
            "instance_group": [{"kind": "KIND_GPU", "count": self._streams, "gpus": gpus}] if gpus
            else [{"kind": "KIND_CPU", "count": self._streams * max(1, len(self._devices))}],
        }

    def prepare(self, request: Any, binary: memoryview, version: str | None) -> Prepared:
        """Check a decoded request against the model and take each input's bytes (InvalidRequest if wrong)."""
        if not isinstance(request, dict):
            raise InvalidRequest("the request is not a JSON object")
        unknown = sorted(set(request) - {"id", "parameters", "inputs", "outputs"})
        if unknown:
            raise InvalidRequest(f"the request has unknown field {unknown[0]!r}")
        request_id = request.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest("the request's id must be a string")
        parameters = _parameters(request, "the request")
        timeout_ms = None
        if "timeout" in parameters:
            timeout = parameters["timeout"]
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
                raise InvalidRequest("parameters.timeout must be a positive number of microseconds")
            timeout_ms = max(1, math.ceil(timeout / 1000))
        binary_default = parameters.get("binary_data_output", False) is True
        given = request.get("inputs")
        if not isinstance(given, list) or not given:
            raise InvalidRequest(f"the request has no inputs; {self.name} takes {', '.join(self.inputs)}")
        by_name: dict[str, tuple[str, tuple[int, ...], Buffer]] = {}
        offset = 0
        for entry in given:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise InvalidRequest("each input is an object with a name")
            name = entry["name"]
            what = f"input {name!r}"
            if name not in self.inputs:
                raise InvalidRequest(f"{self.name} has no input {name!r}; it takes {', '.join(self.inputs)}")
            if name in by_name:
                raise InvalidRequest(f"{what} is given twice")
            spec = self.config.inputs[self.inputs.index(name)]
            dtype = tensors.wire_dtype(entry.get("datatype"), what)
            if dtype != spec.dtype:
                raise InvalidRequest(f"{what} is {tensors.WIRE_TO_DATATYPE[dtype]}, but {self.name} takes "
                                     f"{tensors.WIRE_TO_DATATYPE[spec.dtype]}")
            shape = tensors.check_shape(entry.get("shape"), what)
            size = _parameters(entry, what).get("binary_data_size")
            if size is not None:
                if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                    raise InvalidRequest(f"{what} has binary_data_size {size!r}, but {len(binary) - offset} "
                                         "bytes of binary data are left")
                if "data" in entry:
                    raise InvalidRequest(f"{what} has both data and binary_data_size")
                by_name[name] = (dtype, shape, tensors.from_bytes(binary[offset:offset + size], dtype, shape, what))
                offset += size
            elif "data" in entry:
                by_name[name] = (dtype, shape, tensors.from_json(entry["data"], dtype, shape, what))
            else:
                raise InvalidRequest(f"{what} has neither data nor parameters.binary_data_size")
        missing = [n for n in self.inputs if n not in by_name]
        if missing:
            raise InvalidRequest(f"the request lacks input {missing[0]!r}; {self.name} takes {', '.join(self.inputs)}")
        if offset != len(binary):
            raise InvalidRequest(f"{len(binary) - offset} bytes of binary data follow that no input claims")
        return Prepared([by_name[n] for n in self.inputs], timeout_ms, request_id,
                        self._requested(request.get("outputs"), binary_default), binary_default)

    def _requested(self, outputs: Any, binary_default: bool) -> dict[str, bool] | None:
        if outputs is None:
            return None
        if not isinstance(outputs, list):
            raise InvalidRequest("the request's outputs are not a list")
        known = [output_name(self.config, i) for i in range(len(self.outputs))]
        requested: dict[str, bool] = {}
        for entry in outputs:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise InvalidRequest("each requested output is an object with a name")
            if entry["name"] not in known:
                raise InvalidRequest(f"{self.name} has no output {entry['name']!r}; it has {', '.join(known)}")
            binary = _parameters(entry, f"output {entry['name']!r}").get("binary_data", binary_default)
            requested[entry["name"]] = binary is True
        return requested

    def respond(self, reply: ReplyHeader, outputs: list[memoryview],
                prepared: Prepared) -> tuple[dict[str, Any], list[memoryview]]:
        """The response's JSON and the binary parts that follow it, in order."""
        entries = []
        binary: list[memoryview] = []
        for index, (meta, data) in enumerate(zip(reply.outputs, outputs)):
            name = output_name(self.config, index)
            as_binary = prepared.binary if prepared.outputs is None else prepared.outputs.get(name)
            if as_binary is None:
                continue
            entry: dict[str, Any] = {"name": name, "datatype": tensors.WIRE_TO_DATATYPE[meta.dtype],
                                     "shape": list(meta.shape)}
            if as_binary:
                entry["parameters"] = {"binary_data_size": len(data)}
                binary.append(data)
            else:
                entry["data"] = tensors.to_json(data, meta.dtype)
            entries.append(entry)
        response: dict[str, Any] = {"model_name": self.name, "model_version": reply.version, "outputs": entries}
        if prepared.request_id is not None:
            response["id"] = prepared.request_id
        return response, binary


class Catalog:
    """The models, from the gateway's config and the supervisor's word on their state (refreshed each second)."""

    def __init__(self, config: Config, devices: list[str], control: Control) -> None:
        self.config = config
        self._devices = devices
        self._control = control
        self._state: dict[str, Any] = {}
        self._read_at = -math.inf

    async def model(self, name: str, version: str | None) -> ModelView:
        """The model `name`, at `version` if one is named: NotFound unless it is the live one."""
        if name not in self.config.models:
            raise NotFound(f"unknown model {name!r}; this daemon serves {', '.join(sorted(self.config.models))}")
        if time.monotonic() - self._read_at > FRESH_S:
            self._state = await self._control.call("models")
            self._read_at = time.monotonic()
        state = self._state[name]
        if version is not None and version != state["live_version"]:
            raise NotFound(f"version {version!r} of {name} is not served; the live version is "
                           f"{state['live_version']!r}")
        return ModelView(name, self.config.models[name], state, self.config.workers.streams, self._devices)

    async def statistics(self, name: str, version: str | None) -> dict[str, Any]:
        """The statistics extension's answer, from the numbers `inferctl stats` keeps."""
        versions = (await self._control.call("models"))[name]["versions"]
        model_stats = []
        for served, numbers in sorted(versions.items()):
            if version is not None and served != version:
                continue
            requests = numbers["requests"]
            ok = requests.get(protocol.OK, 0)
            failed = sum(n for status, n in requests.items() if status != protocol.OK)

            def spent(count: int, seconds: float) -> dict[str, int]:
                return {"count": count, "ns": int(seconds * 1e9)}

            model_stats.append({
                "name": name, "version": served, "last_inference": int(numbers["last_inference_s"] * 1000),
                "inference_count": numbers["samples"], "execution_count": numbers["batches"],
                "inference_stats": {
                    "success": spent(ok, numbers["total_s"]), "fail": spent(failed, 0.0),
                    "queue": spent(ok, numbers["queue_s"]), "compute_input": spent(ok, 0.0),
                    "compute_infer": spent(ok, numbers["compute_s"]), "compute_output": spent(ok, 0.0),
                },
                "batch_stats": [{"batch_size": size, "compute_infer": spent(count, 0.0)}
                                for size, count in sorted(numbers["batch_sizes"].items(), key=lambda kv: int(kv[0]))],
            })
        return {"model_stats": model_stats}
