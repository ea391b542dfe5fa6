"""TorchScript and torch.export models the tests build, with fixed seeds.

Each builder writes `ROOT/NAME/VERSION/model.pt` (or `.pt2`); the tests load
the same file in-process to check what the daemon answers.
"""

from __future__ import annotations

from pathlib import Path

import torch

MLP_IN, MLP_OUT = 16, 4
SLOW_FEATURES = 64


class Mlp(torch.nn.Module):
    """float32 [16] -> [4]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(MLP_IN, 32), torch.nn.ReLU(), torch.nn.Linear(32, MLP_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwoInTwoOut(torch.nn.Module):
    """(float32 [3, 4], int64 [2]) -> (float32 [3], int64 [2]): two inputs, two outputs, two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(4))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (a * self.scale).sum(-1), b * 2 + 1


class Slow(torch.nn.Module):
    """float32 [64] -> [64], a chain of small matmuls: milliseconds per batch, for queueing tests."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.weight = torch.nn.Parameter(torch.randn(SLOW_FEATURES, SLOW_FEATURES) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(self.steps):
            y = torch.tanh(y @ self.weight)
        return y


class Failing(torch.nn.Module):
    """float32 [2] -> [2]; raises for any batch whose first value is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x[0, 0] < 0):
            raise RuntimeError("negative input refused by the model")
        return x * 3


class WrongBatch(torch.nn.Module):
    """Returns one row whatever the batch size: a model the daemon must refuse at warm-up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True)


def save_script(module: torch.nn.Module, root: Path, name: str, version: str, seed: int) -> Path:
    """Script `module` (built under `seed`) and save it as NAME/VERSION/model.pt."""
    path = root / name / version / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def save_export(module: torch.nn.Module, example: tuple[torch.Tensor, ...], root: Path, name: str, version: str) -> Path:
    """Export `module` with a dynamic batch dim and save it as NAME/VERSION/model.pt2."""
    path = root / name / version / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(module.eval(), example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def build_repository(root: Path) -> dict[str, Path]:
    """Every test model; returns the file of each NAME/VERSION."""
    files = {}
    torch.manual_seed(1)
    files["mlp/v1"] = save_script(Mlp(), root, "mlp", "v1", 1)
    torch.manual_seed(2)
    files["mlp/v2"] = save_script(Mlp(), root, "mlp", "v2", 2)
    torch.manual_seed(3)
    files["pair/v1"] = save_script(TwoInTwoOut(), root, "pair", "v1", 3)
    torch.manual_seed(4)
    files["slow/v1"] = save_script(Slow(300), root, "slow", "v1", 4)
    files["failing/v1"] = save_script(Failing(), root, "failing", "v1", 5)
    files["wrongbatch/v1"] = save_script(WrongBatch(), root, "wrongbatch", "v1", 6)
    torch.manual_seed(7)
    files["exported/v1"] = save_export(Mlp(), (torch.randn(2, MLP_IN),), root, "exported", "v1")
    return files
