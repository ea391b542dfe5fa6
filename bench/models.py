"""The benchmark's models, built in pure torch with a fixed seed and saved as TorchScript."""

from __future__ import annotations

from pathlib import Path

import torch

MLP_SHAPE = (256,)
CNN_SHAPE = (3, 64, 64)
ECHO_SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20}  # bytes of float32 per request


def mlp() -> torch.nn.Module:
    """float32 [256] -> 1024 -> 1024 -> 10, ReLU."""
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


class Residual(torch.nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1, strided, where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False),
            torch.nn.BatchNorm2d(channels_out), torch.nn.ReLU(),
            torch.nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False),
            torch.nn.BatchNorm2d(channels_out),
        )
        self.shortcut = (
            torch.nn.Identity() if stride == 1 and channels_in == channels_out
            else torch.nn.Sequential(torch.nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                     torch.nn.BatchNorm2d(channels_out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def cnn() -> torch.nn.Module:
    """float32 [3, 64, 64]: stem conv stride 2 to 32 channels, residual blocks at 32 and 64, pool, linear 10."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, 2, 1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        Residual(32, 32, 1), Residual(32, 64, 2),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )


class Echo(torch.nn.Module):
    """The identity: what comes in goes out (the payload benchmark)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def save(module: torch.nn.Module, root: Path, name: str, version: str) -> Path:
    """Save as ROOT/NAME/VERSION/model.pt (once)."""
    path = root / name / version / "model.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def build(root: Path, seed: int = 0) -> None:
    """Every benchmark model; mlp also as v2 (other weights), for the reload benchmark."""
    for name, make in (("mlp", mlp), ("cnn", cnn), ("echo", Echo)):
        torch.manual_seed(seed)
        save(make(), root, name, "v1")
    torch.manual_seed(seed + 1)
    save(mlp(), root, "mlp", "v2")
