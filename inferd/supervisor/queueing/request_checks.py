"""What a request must be to be queued for a model: its inputs checked against the model's, and what it
batches by. The frontend checks each client's request with it, and a pipeline each step's request."""

from __future__ import annotations

import math

from inferd import protocol
from inferd.config.schema import ModelConfig
from inferd.errors import InvalidRequest
from inferd.supervisor.queueing.queue import Shapes


def check_against_model(header: protocol.RequestHeader, name: str,
                        model: ModelConfig) -> tuple[int, Shapes, int | None]:
    """Check a request's inputs against what the model takes; return its sample count, what it batches by
    (its samples' shapes, or where they are padded to buckets their buckets; () for a model of fixed shapes,
    or one padded to each batch's longest request: every request batches with every other) and, where the
    model takes inputs of any size, the input elements of each of its samples; or raise InvalidRequest."""
    rid = header.id
    if len(header.inputs) != len(model.inputs):
        raise InvalidRequest(f"{name} takes {len(model.inputs)} input(s), the request has {len(header.inputs)}", rid)
    samples = header.inputs[0].shape[0]
    for index, (meta, spec) in enumerate(zip(header.inputs, model.inputs)):
        if meta.dtype != spec.dtype:
            raise InvalidRequest(f"input {index} is {meta.dtype} but {name} takes {spec.dtype}", rid)
        if not spec.fits(tuple(meta.shape[1:])):
            bound = f" (each -1 at most as in max_shape {list(spec.bound)})" if spec.variable else ""
            raise InvalidRequest(
                f"input {index} has shape {list(meta.shape)}; {name} takes [N, "
                f"{', '.join(map(str, spec.shape))}]{bound} with the batch dim N first",
                rid,
            )
        if meta.shape[0] != samples:
            raise InvalidRequest(f"input {index} has batch dim {meta.shape[0]} but input 0 has {samples}", rid)
    if samples > model.max_batch_size:
        raise InvalidRequest(
            f"the request carries {samples} samples, over max_batch_size {model.max_batch_size} of {name}", rid
        )
    if not model.variable:
        return samples, (), None
    elements = sum(math.prod(meta.shape[1:]) for meta in header.inputs)
    if not model.batches_by_shape:  # padded to each batch's longest request
        return samples, (), elements
    if model.padded:  # a request batches with those of its bucket
        return samples, tuple(tuple(model.bucket(size, most) if dim == -1 else size
                                    for size, dim, most in zip(meta.shape[1:], spec.shape, spec.bound))
                              for meta, spec in zip(header.inputs, model.inputs)), elements
    return samples, tuple(meta.shape[1:] for meta in header.inputs), elements
