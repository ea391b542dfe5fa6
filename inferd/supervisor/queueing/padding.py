"""Padding: requests whose inputs differ in their -1 dims stacked as one batch, and each one's outputs cut back.

Where a model's inputs have a pad_value, the batcher puts together requests of one shape bucket (and of
smaller ones riding along). Their batch is padded to the bucket (without shape_buckets, to its longest
request): each request's samples are copied into the top corner of a block filled with the pad value. An
output whose size follows an input's (`unpad` in the config; its varying dims as the worker found them at
warm-up) comes back at the padded size and is cut back to each request's own before it is sent, so the
padding never reaches a reply.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferd.config.schema import ModelConfig
from inferd.errors import InvalidRequest
from inferd.ipc.messages import TensorSpec
from inferd.models.unpad import Cut, cuts
from inferd.protocol import BYTES, DTYPES, Buffer, TensorMeta, tensor_bytes
from inferd.supervisor.queueing.queue import QueuedRequest
from inferd.supervisor.shared.regions import RegionSlice


def batch_shapes(model: ModelConfig, requests: Sequence[QueuedRequest]) -> list[tuple[int, ...]]:
    """Each input's per-sample shape in a batch of `requests`: the requests' own, or where they are padded the
    bucket of the largest (the batcher took only requests of one shape where nothing is padded)."""
    first = [tuple(meta.shape[1:]) for meta in requests[0].header.inputs]
    if not model.padded:
        return first
    shapes = []
    for index, (spec, shape) in enumerate(zip(model.inputs, first)):
        largest = [max(r.header.inputs[index].shape[1 + dim] for r in requests) if size == -1 else shape[dim]
                   for dim, size in enumerate(spec.shape)]
        shapes.append(tuple(model.bucket(size, most) if dim == -1 else size
                            for size, dim, most in zip(largest, spec.shape, spec.bound)))
    return shapes


def stack_padded(target: memoryview, dtype: str, shape: tuple[int, ...], pad_value: float,
                 requests: Sequence[QueuedRequest], index: int, read: type[Exception]) -> None:
    """Fill `target` with input `index` of `requests`, one after the other, each sample padded to `shape`
    with `pad_value`. A request whose input lies in a region it can no longer read raises `read(request,
    error)`."""
    block = np.ndarray((sum(r.samples for r in requests), *shape), dtype=DTYPES[dtype], buffer=target)
    block.fill(pad_value)
    row = 0
    for request in requests:
        meta = request.header.inputs[index]
        value = request.buffers[index]
        if isinstance(value, RegionSlice):
            copy = bytearray(len(value))
            try:
                value.read_into(memoryview(copy))
            except InvalidRequest as exc:
                raise read(request, exc) from None
            value = copy
        given = np.frombuffer(value, dtype=DTYPES[dtype]).reshape(meta.shape)
        block[(slice(row, row + request.samples), *(slice(0, size) for size in meta.shape[1:]))] = given
        row += request.samples


def output_bytes(model: ModelConfig, outputs: Sequence[TensorSpec], index: int, inputs: Sequence[TensorMeta],
                 samples: int) -> int | None:
    """The bytes output `index` of a request (of `samples` samples, `inputs` as it sent them) comes back in,
    where that is known before it is computed: an output of fixed size, or one cut back to the request's
    own size of the input dims it follows; None for an output whose size only the model knows (BYTES too)."""
    spec = outputs[index]
    if spec.dtype == BYTES:
        return None
    sizes: dict[int, int] = {}
    if spec.varies:
        cut = next((cut for cut in cuts(model, outputs) if cut.output == index), None) if model.padded else None
        if cut is None:
            return None
        sizes = cut.sizes(inputs[cut.source].shape[1:])
    return samples * tensor_bytes(spec.dtype, tuple(sizes.get(dim, size) for dim, size in enumerate(spec.shape)))


def cut_rows(rows: Buffer, dtype: str, shape: tuple[int, ...], cut: Cut,
             request: QueuedRequest) -> tuple[TensorMeta, memoryview]:
    """A request's rows of a padded output (`shape`, batch dim first) cut back to its own size."""
    sizes = cut.sizes(request.header.inputs[cut.source].shape[1:])
    padded = np.ndarray(shape, dtype=DTYPES[dtype], buffer=rows)
    own = np.ascontiguousarray(padded[(slice(None), *(slice(0, sizes.get(dim, size))
                                                      for dim, size in enumerate(shape[1:])))])
    return TensorMeta(dtype, own.shape), own.reshape(-1).view(np.uint8).data
