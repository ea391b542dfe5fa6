"""The padding check: a version whose inputs are padded must answer a sample padded as it answers it at its
own size, or requests batched with longer ones would be answered wrong without a word.

At load, one sample is computed at its own size and padded as a batch pads it: each -1 dim to the next shape
bucket above its size (never past max_shape), or without shape_buckets to max_shape. The sample is the
version's example input (example_input.npy) where it is one of the model's only input and padding changes
it; else one made for the check, never the pad value (zeros padded with zeros would pass a mean pool): each
-1 dim half the size it is padded to, floats drawn from [0.5, 1.5) (from [-1.5, -0.5) where pad_value lies in
the first), integers pad_value + 1 (an id any embedding holds, a mask that keeps), booleans not pad_value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from inferd.config.schema import InputSpec, ModelConfig
from inferd.ipc.messages import TensorSpec
from inferd.models.unpad import cuts
from inferd.protocol import DTYPES

SEED = 49


class PaddedSample(NamedTuple):
    """One sample (a batch of one or more, one array per input) at its own size and padded, and what it is."""

    own: list[np.ndarray]
    padded: list[np.ndarray]
    what: str


def check(name: str, version: str, model: ModelConfig, outputs: Sequence[TensorSpec], example: Path,
          run: Callable[[list[np.ndarray]], Sequence[np.ndarray]]) -> str | None:
    """The padding check of `version`, whose example input is at `example` if it has one, where its inputs are
    padded: the sentence refusing it (difference), or None where it passes or nothing is padded. `run` computes
    the version on a batch, one array per input, and gives its outputs as arrays (a worker's on its device, a
    Python model's in its process)."""
    if not model.padded:
        return None
    sample = padded_sample(model, _example_input(example))
    if sample is None:
        return None
    return difference(name, version, model, outputs, sample, run(sample.own), run(sample.padded))


def padded_sample(model: ModelConfig, example: np.ndarray | None) -> PaddedSample | None:
    """The sample the padding check of `model` computes: `example` (the version's example input, if it has
    one) where it fits, else one made for the check; None where padding changes no sample (every -1 dim
    bounded at 1)."""
    if example is not None and _fits(model, example):
        padded = [_pad(example, _padded_shape(model, model.inputs[0], example.shape[1:]),
                       model.inputs[0].pad_value)]
        if padded[0].shape != example.shape:
            return PaddedSample([example], padded, "its example input")
    rng = np.random.default_rng(SEED)
    own = [_made(spec, (1, *_made_shape(model, spec)), rng) for spec in model.inputs]
    padded = [_pad(x, _padded_shape(model, spec, x.shape[1:]), spec.pad_value) for spec, x in zip(model.inputs, own)]
    if all(x.shape == y.shape for x, y in zip(own, padded)):
        return None
    return PaddedSample(own, padded, "a sample made for the check")


def difference(name: str, version: str, model: ModelConfig, outputs: Sequence[TensorSpec], sample: PaddedSample,
               own: Sequence[np.ndarray], padded: Sequence[np.ndarray]) -> str | None:
    """The sentence refusing `version` where its answers to `sample` at its own size (`own`) and padded
    (`padded`) differ beyond models.NAME.padding_rtol and padding_atol; None where they agree. An output of
    the inputs' size is cut back to the sample's own first (unpad); one without unpad is left to the
    supervisor, which refuses the version for it (unpad.unpad_problem)."""
    of_output = {cut.output: cut for cut in cuts(model, outputs)}
    for index, (spec, want, answer) in enumerate(zip(outputs, own, padded)):
        cut = of_output.get(index)
        if spec.varies and cut is None:
            continue
        got = answer
        if cut is not None:
            sizes = cut.sizes(sample.own[cut.source].shape[1:])
            got = answer[(slice(None), *(slice(0, sizes.get(dim, size)) for dim, size in enumerate(answer.shape[1:])))]
        if got.shape != want.shape:
            by = f"is {list(got.shape[1:])} instead of {list(want.shape[1:])}"
        else:
            a, b = want.astype(np.float64), got.astype(np.float64)
            if np.allclose(b, a, rtol=model.padding_rtol, atol=model.padding_atol, equal_nan=True):
                continue
            by = f"differs by up to {float(np.max(np.abs(b - a))):.3g}"
        named = model.outputs[index].name if index < len(model.outputs) else None
        return (f"padding changes the answer of {name} {version}: output {index}{f' ({named})' if named else ''} "
                f"of {sample.what} ({_shapes(model, sample.own)}) {by} once padded ({_shapes(model, sample.padded)}; "
                f"models.{name}.padding_rtol = {model.padding_rtol:g}, padding_atol = {model.padding_atol:g}); "
                "mask the padding in the model (an attention mask, masked pooling), or drop pad_value so that "
                "requests batch by exact shape")
    return None


def _example_input(path: Path) -> np.ndarray | None:
    """A version's example input, if it has one that can be read (the canary check says why not, where it
    needs it)."""
    try:
        return np.load(path, allow_pickle=False) if path.exists() else None
    except (OSError, ValueError):
        return None


def _fits(model: ModelConfig, example: np.ndarray) -> bool:
    """Whether `example` is a batch of samples of the model's only input."""
    if len(model.inputs) != 1:
        return False
    spec = model.inputs[0]
    return example.dtype == DTYPES[spec.dtype] and example.ndim == len(spec.shape) + 1 and example.shape[0] > 0 \
        and spec.fits(tuple(example.shape[1:]))


def _target(model: ModelConfig, size: int, bound: int) -> int:
    """What a -1 dim of `size` (at most `bound`) is padded to: the next shape bucket above it, never past
    `bound`; without one, `bound`."""
    return next((min(bucket, bound) for bucket in model.shape_buckets if bucket > size), bound)


def _padded_shape(model: ModelConfig, spec: InputSpec, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(_target(model, size, most) if dim == -1 else size
                 for size, dim, most in zip(shape, spec.shape, spec.bound))


def _made_shape(model: ModelConfig, spec: InputSpec) -> tuple[int, ...]:
    """A made sample's per-sample shape: each -1 dim half what the first bucket above 1 pads it to."""
    return tuple(max(1, _target(model, 1, most) // 2) if dim == -1 else dim
                 for dim, most in zip(spec.shape, spec.bound))


def _made(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values for `spec` of `shape` (batch dim first) that are not its pad value."""
    dtype = DTYPES[spec.dtype]
    pad = spec.pad_value or 0.0
    if dtype == np.bool_:
        return np.full(shape, not pad, dtype)
    if dtype.kind in "iu":
        above = int(pad) + 1
        return np.full(shape, above if above <= np.iinfo(dtype).max else int(pad) - 1, dtype)
    low = -1.5 if 0.5 <= pad < 1.5 else 0.5
    return rng.uniform(low, low + 1, shape).astype(dtype)


def _pad(x: np.ndarray, shape: tuple[int, ...], pad_value: float | None) -> np.ndarray:
    """`x` (batch dim first) with each sample padded to `shape`: copied into the top corner of a block
    filled with `pad_value`, as a batch of requests is."""
    block = np.full((x.shape[0], *shape), pad_value or 0.0, dtype=x.dtype)
    block[(slice(None), *(slice(0, size) for size in x.shape[1:]))] = x
    return block


def _shapes(model: ModelConfig, inputs: Sequence[np.ndarray]) -> str:
    """Each input's name and per-sample shape."""
    return ", ".join(f"{name} {list(x.shape[1:])}" for name, x in zip(model.input_names(), inputs))
