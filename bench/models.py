"""The benchmark's models, built in pure torch with a fixed seed and saved as TorchScript."""

from __future__ import annotations

from pathlib import Path

import torch

MLP_SHAPE = (256,)


def mlp() -> torch.nn.Module:
    """float32 [256] -> 1024 -> 1024 -> 10, ReLU."""
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def save(module: torch.nn.Module, root: Path, name: str, version: str, seed: int) -> Path:
    """Build under `seed` and save as ROOT/NAME/VERSION/model.pt (once)."""
    path = root / name / version / "model.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def build(root: Path, seed: int = 0) -> None:
    """Every benchmark model, versions v1 and v2 (different weights) of each."""
    for version, offset in (("v1", 0), ("v2", 1)):
        torch.manual_seed(seed + offset)
        save(mlp(), root, "mlp", version, seed + offset)
