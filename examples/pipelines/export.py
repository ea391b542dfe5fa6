"""Save the tensor models of the example pipelines (inferd.toml) into their version folders, with random
weights: `python export.py` (it needs torchvision for ResNet-18).

- encoder/v1/model.pt2: token ids int64 [N, L] -> hidden states float32 [N, L, 32], exported with both the
  batch and the sequence length dynamic (L up to MAX_TOKENS), so texts of any length up to it are served.
- resnet18/v1/model.pt2: pixels float32 [N, 3, 32, 32] -> logits float32 [N, 1000].
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 16  # the tokenizer's (examples/python-models/tokenizer)
VOCABULARY = 14  # the tokenizer's words; id 0 is its padding
WIDTH = 32
SIZE = 32  # the thumbnail step's pixels per side (examples/python-models/thumbnail)


class Encoder(torch.nn.Module):
    """One self-attention block over token embeddings; padding (id 0) is never attended to."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(MAX_TOKENS, WIDTH) * 0.02)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH)
        scores = scores.masked_fill((ids == 0)[:, None, :], -1e9)
        x = self.norm(x + scores.softmax(dim=-1) @ v)
        return x + self.mlp(x)


def export_encoder(folder: Path, seed: int = 0) -> Path:
    """Save an Encoder of random weights (seeded) as folder/v1/model.pt2."""
    torch.manual_seed(seed)
    batch, length = torch.export.Dim("batch", max=1024), torch.export.Dim("length", max=MAX_TOKENS)
    example = (torch.randint(1, VOCABULARY, (2, 5)),)
    program = torch.export.export(Encoder().eval(), example, dynamic_shapes=({0: batch, 1: length},))
    return _save(program, folder)


def export_classifier(module: torch.nn.Module, folder: Path) -> Path:
    """Save `module` (pixels [N, 3, SIZE, SIZE] -> logits) as folder/v1/model.pt2."""
    example = (torch.rand(2, 3, SIZE, SIZE),)
    program = torch.export.export(module.eval(), example, dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
    return _save(program, folder)


def _save(program: torch.export.ExportedProgram, folder: Path) -> Path:
    path = folder / "v1" / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


if __name__ == "__main__":
    import torchvision

    export_encoder(HERE / "encoder")
    torch.manual_seed(0)
    export_classifier(torchvision.models.resnet18(weights=None), HERE / "resnet18")
