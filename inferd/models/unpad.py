"""Which outputs of a padded model are cut back to each request's own size, and to what.

An output whose size follows an input's (`unpad` in the config) comes back at the padded size; the dims the
worker found varying at warm-up are cut back to the sizes the request's input had. The supervisor cuts each
reply so; the worker, checking at load that padding leaves a version's answer alone, cuts its padded sample so;
and a version whose varying outputs say no such thing is refused (unpad_problem).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.config.schema import ModelConfig
from inferd.ipc.messages import TensorSpec


@dataclass(frozen=True)
class Cut:
    """An output cut back to each request's size: its per-sample dims `dims` follow the per-sample dims
    `source_dims` of input `source`."""

    output: int
    dims: tuple[int, ...]
    source: int
    source_dims: tuple[int, ...]

    def sizes(self, source_shape: Sequence[int]) -> dict[int, int]:
        """The size of each of its dims (per-sample dim -> size) where input `source` has the per-sample shape
        `source_shape`."""
        return dict(zip(self.dims, (source_shape[dim] for dim in self.source_dims)))


def cuts(model: ModelConfig, outputs: Sequence[TensorSpec]) -> tuple[Cut, ...]:
    """How each output of a padded model is cut back (none for those of fixed size)."""
    names = model.input_names()
    found = []
    for index, (output, spec) in enumerate(zip(model.outputs, outputs)):
        follows = output.follows(model.inputs, names)
        if follows is not None and spec.varies:
            found.append(Cut(index, spec.varies, *follows))
    return tuple(found)


def unpad_problem(name: str, model: ModelConfig, outputs: Sequence[TensorSpec]) -> str | None:
    """Why a version's outputs cannot be cut back to each request's size; None when they can."""
    if not model.padded:
        return None
    names = model.input_names()
    for index, spec in enumerate(outputs):
        output = model.outputs[index] if index < len(model.outputs) else None
        follows = output.follows(model.inputs, names) if output is not None else None
        if spec.varies and follows is None:
            return (f"output {index} of {name} has dims {list(spec.varies)} whose size follows the inputs', and its "
                    f"padding would reach the replies: say which input dims they follow with unpad in "
                    f"models.{name}.outputs (e.g. unpad = \"{names[0]}\")")
        if follows is not None and len(follows[1]) != len(spec.varies):
            return (f"output {index} of {name} varies in {len(spec.varies)} dim(s) {list(spec.varies)}, but its unpad "
                    f"names {len(follows[1])} input dim(s)")
    return None
