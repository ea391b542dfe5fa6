"""numpy arrays and torch tensors of the wire's dtypes, sharing memory both ways.

`torch.from_numpy` and `Tensor.numpy` know no bfloat16 (numpy has none; the
wire's is ml_dtypes'), so a bfloat16 one passes through int16, which has the
same size: its bits are viewed under the other name, never converted or copied.
This module imports torch: the workers and a client handed tensors use it, the
supervisor never does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor over `array`'s memory, like `torch.from_numpy`, for ml_dtypes' bfloat16 too."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array, like `Tensor.numpy`; bfloat16 as ml_dtypes.bfloat16."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()
