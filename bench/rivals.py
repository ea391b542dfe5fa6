"""What the other servers of bench/compare.py share: their settings, the model's loading and its forward pass.

Each is set up as bench/compare.py's docstring says: two model replicas of one torch thread each, batches of
up to BATCH samples formed within WINDOW_S, on 127.0.0.1 (bench/serve_litserve.py, bench/serve_rayserve.py;
TorchServe's handler, bench/torchserve_handler.py, stands alone: TorchServe imports it from the model's archive).
"""

from __future__ import annotations

from typing import Any

import numpy as np

BATCH = 32
WINDOW_S = 0.002
REPLICAS = 2


def load(path: str) -> Any:
    """The TorchScript model, with one torch thread."""
    import torch

    torch.set_num_threads(1)
    return torch.jit.load(path).eval()


def forward(model: Any, samples: list[np.ndarray]) -> np.ndarray:
    """One batch of samples through the model."""
    import torch

    with torch.inference_mode():
        return model(torch.from_numpy(np.stack(samples))).numpy()
