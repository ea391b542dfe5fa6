"""TorchScript and torch.export models the tests build, with fixed seeds.

Each builder writes `ROOT/NAME/VERSION/model.pt` (or `.pt2`); the tests load
the same file in-process to check what the daemon answers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import List  # noqa: UP035 - TorchScript reads typing.List

import numpy as np
import torch

MLP_IN, MLP_OUT = 16, 4
SLOW_FEATURES = 64
BF16_FEATURES = 8
GATES = "gates"  # the repository's folder of gates for `variable` (tests/gates.py)


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


class Bfloat16Mix(torch.nn.Module):
    """bfloat16 [8] -> (bfloat16 [8], float32 [1]): x * weight + 1 in bfloat16 (bfloat16 weights), and
    each sample's largest magnitude in float32. Elementwise ops and a max are exact whatever the batch,
    so the daemon's answers equal the model's in-process ones bit for bit. `steps` tiny additions on
    the way (Sleepy's busy loop) make a batch take milliseconds, so that requests queue and batch."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.weight = torch.nn.Parameter(torch.randn(BF16_FEATURES).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros((), device=x.device)
        for _ in range(self.steps):
            acc = acc + 1.0
        # A 0-dim float32 tensor does not promote a bfloat16 one: y stays bfloat16.
        y = x * self.weight + 1.0 + acc * 0.0
        return y, x.float().abs().amax(-1, keepdim=True)


class ToBfloat16(torch.nn.Module):
    """float32 [2] -> bfloat16 [2]: x * 3 rounded to bfloat16, an output Tensor.numpy() refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).to(torch.bfloat16)


class Failing(torch.nn.Module):
    """float32 [2] -> [2]; raises for any batch whose first value is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x[0, 0] < 0):
            raise RuntimeError("negative input refused by the model")
        return x * 3


class Sum(torch.nn.Module):
    """float32 [F] -> [1]: each sample's sum; large requests, small replies (for memory bounds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


class SeesBatch(torch.nn.Module):
    """float32 [2] -> (float32 [2], float32 [1]): each sample doubled, and the batch size the model was run at
    (the second output shows padding that the first must never show)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.full((x.shape[0], 1), float(x.shape[0]))


class RunsOutOfMemory(torch.nn.Module):
    """float32 [2] -> [2]; for a batch whose first value is negative, raises what PyTorch raises when
    the device has no memory left (a "CUDA error" in its text: not one that poisons the context)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x[0, 0] < 0):
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (CUDA error: out of memory)")
        return x * 3


class Allocates(torch.nn.Module):
    """float32 [2] -> [2], allocating as many floats on its device as the batch's first value says:
    on a GPU, a real out-of-memory error for a big enough one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(int(x[0, 0].item()), device=x.device)
        return x + scratch[:1].sum() * 0.0


class WrongBatch(torch.nn.Module):
    """Returns one row whatever the batch size: a model the daemon must refuse at warm-up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True)


def save_script(build: Callable[[], torch.nn.Module], root: Path, name: str, version: str, seed: int) -> Path:
    """Build a module with torch seeded to `seed`, script it and save it as NAME/VERSION/model.pt."""
    torch.manual_seed(seed)
    module = build()
    path = root / name / version / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module.eval()), str(path))
    return path


def save_export(module: torch.nn.Module, example: tuple[torch.Tensor, ...], root: Path, name: str,
                version: str) -> Path:
    """Export `module` with a dynamic batch dim and save it as NAME/VERSION/model.pt2."""
    path = root / name / version / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(module.eval(), example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def save_aoti(module: torch.nn.Module, example: tuple[torch.Tensor, ...], root: Path, name: str,
              version: str) -> Path:
    """Export `module` with a dynamic batch dim, compile it with AOTInductor for the CPU and save the package
    as NAME/VERSION/model.pt2 (half a minute of a C++ compiler's time on a small machine)."""
    path = root / name / version / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(module.eval(), example, dynamic_shapes=({0: batch},))
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    return path


def build_formats_repository(root: Path) -> dict[str, Path]:
    """One model `mlp` in each format, each with weights of its own: TorchScript (v1), torch.export (v2) and
    an AOTInductor package for the CPU (v3)."""
    files = {"v1": save_script(Mlp, root, "mlp", "v1", 21)}
    torch.manual_seed(22)
    files["v2"] = save_export(Mlp(), (torch.randn(2, MLP_IN),), root, "mlp", "v2")
    torch.manual_seed(23)
    files["v3"] = save_aoti(Mlp(), (torch.randn(2, MLP_IN),), root, "mlp", "v3")
    return files


def build_repository(root: Path) -> dict[str, Path]:
    """Every test model; returns the file of each NAME/VERSION."""
    files = {}
    files["mlp/v1"] = save_script(Mlp, root, "mlp", "v1", 1)
    files["mlp/v2"] = save_script(Mlp, root, "mlp", "v2", 2)
    files["pair/v1"] = save_script(TwoInTwoOut, root, "pair", "v1", 3)
    files["slow/v1"] = save_script(lambda: Slow(300), root, "slow", "v1", 4)
    files["failing/v1"] = save_script(Failing, root, "failing", "v1", 5)
    files["wrongbatch/v1"] = save_script(WrongBatch, root, "wrongbatch", "v1", 6)
    files["oom/v1"] = save_script(RunsOutOfMemory, root, "oom", "v1", 13)
    files["allocates/v1"] = save_script(Allocates, root, "allocates", "v1", 14)
    torch.manual_seed(7)
    files["exported/v1"] = save_export(Mlp(), (torch.randn(2, MLP_IN),), root, "exported", "v1")
    files["sleepy/v1"] = save_script(lambda: Sleepy(1_000), root, "sleepy", "v1", 8)  # ~5 ms a batch
    files["stuck/v1"] = save_script(lambda: Sleepy(150_000), root, "stuck", "v1", 9)  # ~0.7 s a batch
    files["leaky/v1"] = save_script(lambda: Leaky(150), root, "leaky", "v1", 10)
    (root / GATES).mkdir()
    files["variable/v1"] = save_script(lambda: Variable(str(root / GATES)), root, "variable", "v1", 11)
    files["bigtemp/v1"] = save_script(BigTemporary, root, "bigtemp", "v1", 12)
    files["bf16/v1"] = save_script(lambda: Bfloat16Mix(1_000), root, "bf16", "v1", 15)  # ~5 ms a batch
    files["sum/v1"] = save_script(Sum, root, "sum", "v1", 16)
    files["big/v1"] = save_script(lambda: Wide(4096), root, "big", "v1", 17)  # 344 KiB of weights: 90 mlps
    files["seesbatch/v1"] = save_script(SeesBatch, root, "seesbatch", "v1", 17)
    files["ragged/v1"] = save_script(lambda: Ragged(str(root / GATES)), root, "ragged", "v1", 18)
    files["meanpooled/v1"] = save_script(MeanPooled, root, "meanpooled", "v1", 19)
    files["picky/v1"] = save_script(lambda: Picky(str(root / GATES)), root, "picky", "v1", 20)
    return files


class MlpRefusingBigBatches(Mlp):
    """An Mlp whose warm-up fails: it raises on any batch of more than 8 samples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            raise RuntimeError("batches over 8 are not supported by this version")
        return self.net(x)


class MlpFailingOnSome(Mlp):
    """An Mlp that raises on a batch holding a sample whose first value is above 1 (about one sample in six of
    standard normal inputs): a version a canary guard must take back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > 1.0).any()):
            raise RuntimeError("this version fails on inputs whose first value is above 1")
        return self.net(x)


class Wide(torch.nn.Module):
    """The Mlp's contract (float32 [16] -> [4]) with a hidden layer of `width`: a model of some size."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(MLP_IN, width), torch.nn.ReLU(), torch.nn.Linear(width, MLP_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Head(torch.nn.Module):
    """float32 [16] -> [width]: the Mlp's input with another output shape (16384: 64 KiB a
    sample, too much for a small arena slot)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(MLP_IN, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class WarmsAtGate(Mlp):
    """An Mlp whose every batch is saved to the file `gate` first: where a test made that file a named
    pipe (tests/gates.py), its warm-up, and so its reload, waits there until the test opens it."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.save(x, self.gate)
        return self.net(x)


def save_gated_version(root: Path, version: str, gate: Path) -> Path:
    """Save NAME mlp VERSION `version` under `root`: an Mlp whose warm-up waits at `gate` (WarmsAtGate)."""
    return save_script(lambda: WarmsAtGate(str(gate)), root, "mlp", version, 6)


class HangsOnFullBatches(Mlp):
    """An Mlp whose forward never returns for a batch of 16 or more: its warm-up at max_batch_size hangs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spins = 0
        while x.shape[0] >= 16:
            spins += 1
        return self.net(x) + spins * 0.0


class HugeFailing(torch.nn.Module):
    """300 MB of weights and a forward that always fails: memory must come back after the refusal."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(75_000_000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this version never works")


def build_reload_repository(root: Path) -> dict[str, Path]:
    """Versions of one model `mlp`, good and bad, for blue-green reload tests."""
    files = {}
    for version, seed in (("v1", 1), ("v2", 2), ("v3", 3)):
        files[version] = save_script(Mlp, root, "mlp", version, seed)
    (root / "mlp" / "corrupt").mkdir(parents=True)
    (root / "mlp" / "corrupt" / "model.pt").write_bytes(b"PK\x03\x04 this is not a TorchScript archive")
    files["refuses_big"] = save_script(MlpRefusingBigBatches, root, "mlp", "refuses_big", 4)
    files["wide"] = save_script(lambda: Head(8), root, "mlp", "wide", 5)
    files["huge_output"] = save_script(lambda: Head(16384), root, "mlp", "huge_output", 10)
    files["huge_failing"] = save_script(HugeFailing, root, "mlp", "huge_failing", 7)
    files["hangs"] = save_script(HangsOnFullBatches, root, "mlp", "hangs", 11)
    files["fails_some"] = save_script(MlpFailingOnSome, root, "mlp", "fails_some", 12)
    files["v1_twin"] = save_script(Mlp, root, "mlp", "v1_twin", 1)  # v1's weights in another folder
    for version, seed, honest in (("canary_good", 8, True), ("canary_bad", 9, False)):
        files[version] = save_script(Mlp, root, "mlp", version, seed)
        module = torch.jit.load(str(files[version]))
        example = torch.randn(3, MLP_IN)
        with torch.no_grad():
            expected = module(example) if honest else module(example) + 0.5
        np.save(root / "mlp" / version / "example_input.npy", example.numpy())
        np.save(root / "mlp" / version / "expected_output.npy", expected.numpy())
    return files


class Sleepy(torch.nn.Module):
    """float32 [2] -> [2], computing for about `ms` milliseconds per batch (a busy loop of tiny ops)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(1)
        for _ in range(self.steps):
            acc = acc + 1.0
        return x + acc * 0.0


class Leaky(torch.nn.Module):
    """float32 [2] -> [2], keeping `mib` MiB more memory after every batch: the leak the leak watch must see."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.elements = mib * 2**18  # float32
        self.kept = torch.jit.Attribute([], List[torch.Tensor])  # noqa: UP006 - TorchScript reads typing.List

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append(torch.ones(self.elements))
        return x * 2


class Variable(torch.nn.Module):
    """float32 [2] -> [2], returning its input; the first value of the batch says how many tiny steps it
    computes, or, negative (-n), which gate it waits at: it saves its batch to the file `n` of the folder
    `gates`, which where a test made that file a named pipe waits, taking no CPU, until the test opens it
    (tests/gates.py)."""

    def __init__(self, gates: str) -> None:
        super().__init__()
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = int(x[0, 0].item())
        if first < 0:
            torch.save(x, self.gates + "/" + str(-first))
        acc = torch.zeros(1)
        for _ in range(first):
            acc = acc + 1.0
        return x + acc * 0.0


class Picky(torch.nn.Module):
    """float32 [2] -> [2], x * 3; a batch holding a sample whose second value is negative raises. A batch whose
    first value is -n waits at gate n first, as Variable's."""

    def __init__(self, gates: str) -> None:
        super().__init__()
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = int(x[0, 0].item())
        if first < 0:
            torch.save(x, self.gates + "/" + str(-first))
        if bool((x[:, 1] < 0).any()):
            raise RuntimeError("a negative second value is refused by the model")
        return x * 3


RAGGED_MAX = 64  # the longest sample `ragged` is configured for


class Ragged(torch.nn.Module):
    """float32 [2, L], L of any length -> float32 [L], the running sum of its two rows, and float32 [4], its
    rows' sums through a linear layer. A batch whose first value is -n waits at gate n, as Variable's."""

    def __init__(self, gates: str) -> None:
        super().__init__()
        self.gates = gates
        self.head = torch.nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = int(x[0, 0, 0].item())
        if first < 0:
            torch.save(x, self.gates + "/" + str(-first))
        return torch.cumsum(x[:, 0] + x[:, 1], dim=1), self.head(x.sum(dim=2))


class MeanPooled(torch.nn.Module):
    """float32 [2, L] -> float32 [L] and [4], as Ragged, but pooled by its rows' means over L, without a mask:
    padded, its samples' means take the padding in, and its answer changes."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cumsum(x[:, 0] + x[:, 1], dim=1), self.head(x.mean(dim=2))


class BigTemporary(torch.nn.Module):
    """float32 [2] -> [2], using a 512 MiB temporary on the way: leaves the GPU allocator's cache fragmented."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(134_217_728, device=x.device)  # 512 MiB of float32
        return x + scratch[:2].sum() * 0.0


# ResNet-18 as He et al. define it ("Deep Residual Learning for Image Recognition", 2015: basic blocks of two 3x3
# convolutions, stages of [2, 2, 2, 2] blocks at 64, 128, 256 and 512 channels), written here, not copied:
# torchvision's own cannot be imported beside this machine's CPU torch (its wheels here are CUDA builds).
class BasicBlock(torch.nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (projected by a 1x1 convolution where the
    stride or the channels change)."""

    def __init__(self, given: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(given, channels, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or given != channels:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(given, channels, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(torch.nn.Module):
    """float32 [3, H, W] images -> [1000] logits (H, W at least 32)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
        stages: list[torch.nn.Module] = []
        given = 64
        for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(given, channels, stride), BasicBlock(channels, channels, 1)]
            given = channels
        self.stages = torch.nn.Sequential(*stages)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(self.stages(self.stem(x)), 1)
        return self.fc(pooled.flatten(1))
