"""Models on one device: load a version, warm it up, run a batch.

Files are read with TorchScript (`torch.jit.load`) or torch.export
(`torch.export.load`), never with a bare pickle `torch.load`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from inferd.config import ModelConfig
from inferd.ipc.messages import LoadedModel, TensorSpec
from inferd.protocol import DTYPES
from inferd.repository import model_file

log = logging.getLogger("inferd.worker.runner")

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class ModelError(Exception):
    """A model cannot be loaded, warmed up or run; the message says why."""


def load_module(path: Path, device: torch.device) -> Any:
    """Load a TorchScript or torch.export file onto `device`, in eval mode."""
    try:
        if path.suffix == ".pt2":
            module = torch.export.load(str(path)).module().to(device)
        else:
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:  # torch raises many types for a bad archive
        raise ModelError(f"{path} is not a loadable TorchScript or torch.export file: {exc}") from None
    # torch.export modules reject .eval(); they are traced in eval mode already.
    if isinstance(module, torch.jit.ScriptModule):
        module.eval()
    return module


def as_outputs(result: Any) -> tuple[torch.Tensor, ...]:
    """A model's return value as a tuple of tensors."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result)
    raise ModelError(f"the model returned {type(result).__name__}; return a tensor or a tuple of tensors")


class ModelRunner:
    """The models loaded on one device, by name and version."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._modules: dict[tuple[str, str], Any] = {}

    def load(self, name: str, config: ModelConfig, version: str) -> LoadedModel:
        """Load `version` of model `name`, warm it on the configured batch sizes, return its signature."""
        started = time.perf_counter()
        try:
            path = model_file(config.repository, version)
        except Exception as exc:
            raise ModelError(str(exc)) from None
        module = load_module(path, self.device)
        self._modules[(name, version)] = module
        outputs: tuple[TensorSpec, ...] = ()
        for batch in config.warmup_batch_sizes or (1,):
            inputs = [
                torch.zeros((batch, *spec.shape), dtype=TORCH_DTYPES[spec.dtype], device=self.device)
                for spec in config.inputs
            ]
            try:
                results = self.infer(name, version, inputs)
            except ModelError:
                raise
            except Exception as exc:
                raise ModelError(f"warm-up of {name} {version} at batch {batch} failed: {exc}") from None
            outputs = self.signature(results)
        log.info(
            "loaded %s %s from %s, warmed on batch sizes %s in %.2f s",
            name, version, path, list(config.warmup_batch_sizes or (1,)), time.perf_counter() - started,
        )
        return LoadedModel(version=version, outputs=outputs)

    def infer(self, name: str, version: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run one batch; every output keeps the inputs' batch dim."""
        module = self._modules[(name, version)]
        with torch.inference_mode():
            outputs = as_outputs(module(*inputs))
        batch = inputs[0].shape[0]
        for index, output in enumerate(outputs):
            if output.dim() == 0 or output.shape[0] != batch:
                raise ModelError(
                    f"output {index} has shape {list(output.shape)}; its first dim must be the batch size {batch}"
                )
        return outputs

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
