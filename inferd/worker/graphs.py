"""CUDA graphs of a model at its batch buckets (`models.NAME.cuda_graphs`).

A graph replays the kernels it captured on the very buffers it captured them
with. So each executor gets, for each bucket it was captured at, static input
buffers that a batch is copied into straight from the arena (its last sample
repeated up to the bucket, on the device) and the static outputs the replay
writes, which the executor copies out before it runs its next batch. A batch
above the largest bucket, or of a shape not captured, runs without a graph.

Each executor's graphs are captured on a stream of their own, not on the
executor's: a version loads while the executors go on serving the live one,
and a capture would take in whatever else ran on its stream. They share one
memory pool, since an executor runs one batch at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

Forward = Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]]
Shapes = tuple[tuple[int, ...], ...]


class Capture(Protocol):
    """Records `forward` on `inputs` once; returns what replays it and the outputs each replay rewrites."""

    def __call__(self, forward: Forward, inputs: list[torch.Tensor]) -> tuple[Callable[[], None],
                                                                             tuple[torch.Tensor, ...]]: ...


class CudaCapture:
    """One executor's captures: on a side stream of its own, into one memory pool.

    The mode is thread-local because the worker's other threads go on computing
    (the live version's batches) while a new version is captured. The capture is
    begun and ended by hand: torch.cuda.graph's context manager first waits for
    the whole device and empties the allocator's cache, a stall of the live
    traffic at every capture.
    """

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Forward, inputs: list[torch.Tensor]) -> tuple[Callable[[], None],
                                                                             tuple[torch.Tensor, ...]]:
        self._stream.wait_stream(torch.cuda.current_stream())  # the static inputs are written there
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            forward(inputs)  # once eagerly on this stream first: libraries set up per stream, not while capturing
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                outputs = forward(inputs)
            except BaseException:
                with contextlib.suppress(Exception):  # the capture is broken; end it, and say the model's error
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph.replay, outputs


class Graph:
    """A captured forward at one input shape, with the buffers it reads and writes."""

    def __init__(self, inputs: list[torch.Tensor], replay: Callable[[], None],
                 outputs: tuple[torch.Tensor, ...]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self._replay = replay

    def fill(self, inputs: list[torch.Tensor]) -> None:
        """Copy a batch into the static inputs, from wherever it lies (the arena, the device), and pad it to
        the captured batch size with copies of its last sample made on the device."""
        samples = inputs[0].shape[0]
        for static, x in zip(self.inputs, inputs):
            static[:samples].copy_(x, non_blocking=True)
            if samples < static.shape[0]:
                static[samples:].copy_(static[samples - 1:samples])

    def replay(self) -> tuple[torch.Tensor, ...]:
        """Run the captured kernels on what `fill` put in; the static outputs (valid until the next replay)."""
        self._replay()
        return self.outputs


class Graphs:
    """One executor's graphs of one model version, by the input shapes they were captured at."""

    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        self._graphs: dict[Shapes, Graph] = {}

    def capture(self, forward: Forward, example: list[torch.Tensor]) -> None:
        """Capture `forward` at the shapes and dtypes of `example`, whose values become the static inputs'."""
        inputs = [x.clone() for x in example]
        replay, outputs = self._capture(forward, inputs)
        self._graphs[tuple(tuple(x.shape) for x in inputs)] = Graph(inputs, replay, outputs)

    def find(self, batch: int, inputs: list[torch.Tensor]) -> Graph | None:
        """The graph for `inputs` padded to `batch` samples, if one was captured."""
        return self._graphs.get(tuple((batch, *x.shape[1:]) for x in inputs))

    def __len__(self) -> int:
        return len(self._graphs)
