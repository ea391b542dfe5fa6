"""TorchServe's handler of the benchmark mlp for bench/compare.py: a batch of raw float32 bodies in, each
sample's raw float32 output back.

torch-model-archiver copies this file into the model's archive and TorchServe's worker imports it there, so it
imports nothing of inferd or bench. TorchServe takes a module's one class as its handler.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


class MLPHandler:
    """Loads the TorchScript file of the archive; one torch thread, as each of inferd's CPU executors has."""

    def initialize(self, context: Any) -> None:
        torch.set_num_threads(1)
        path = os.path.join(context.system_properties["model_dir"], "model.pt")
        self.model = torch.jit.load(path).eval()

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        samples = [np.frombuffer(request.get("body") or request.get("data"), dtype=np.float32) for request in data]
        with torch.inference_mode():
            outputs = self.model(torch.from_numpy(np.stack(samples)))
        return [row.numpy().tobytes() for row in outputs]
