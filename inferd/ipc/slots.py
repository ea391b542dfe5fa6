"""Arena slots, and where a batch lies in one: the contract between supervisor and worker.

An arena is cut into equal, page-aligned slots, one batch per slot. In a slot,
the batch's inputs come first, each stacked along the batch dim (request after
request), then its outputs; every tensor starts on an ALIGN boundary. The
supervisor places the inputs (`place` from the slot's start), the worker places
the outputs (`place` from the end of the inputs), and both size a slot for a
full batch with `batch_bytes`, so the two sides cannot disagree.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from inferd.config.schema import ModelConfig
from inferd.ipc.messages import TensorSpec
from inferd.protocol import BYTES, tensor_bytes

ALIGN = 64


def align_up(offset: int, alignment: int = ALIGN) -> int:
    """`offset` rounded up to a multiple of `alignment`."""
    return (offset + alignment - 1) // alignment * alignment


def place(start: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of `sizes` bytes laid one after the other from `start`, each aligned;
    and the offset just past the last one."""
    offsets = []
    offset = start
    for size in sizes:
        offset = align_up(offset)
        offsets.append(offset)
        offset += size
    return offsets, offset


def batch_bytes(model: ModelConfig, outputs: Sequence[TensorSpec], samples: int) -> int:
    """Bytes of slot a batch of `samples` samples of `model` takes at most, inputs (at their largest shape)
    and outputs (`outputs`: the per-sample signature of the model's outputs, as warmed up at that shape); a
    BYTES tensor's size is its elements', which the dispatcher fits to a slot batch by batch."""
    rows = [tensor_bytes(spec.dtype, spec.bound) for spec in model.inputs if spec.dtype != BYTES]
    rows += [tensor_bytes(spec.dtype, spec.shape) for spec in outputs if spec.dtype != BYTES]
    return place(0, [samples * row for row in rows])[1]


def slot_shortfall(name: str, model: ModelConfig, outputs: Sequence[TensorSpec], slot_size: int) -> str | None:
    """Why a full batch of model `name` would not fit a slot of `slot_size` bytes; None when it fits."""
    needed = batch_bytes(model, outputs, model.max_batch_size)
    if needed <= slot_size:
        return None
    return (f"a full batch of {name} needs {needed / 2**20:.1f} MiB of arena slot but a slot has "
            f"{slot_size / 2**20:.1f} MiB (workers.shm_mb / (2 x workers.streams)); "
            "raise workers.shm_mb or lower max_batch_size")


class SlotPool:
    """Equal, page-aligned slots of one arena, handed out and taken back by index."""

    def __init__(self, arena_size: int, count: int) -> None:
        self.slot_size = arena_size // count // mmap.PAGESIZE * mmap.PAGESIZE
        if self.slot_size == 0:
            raise ValueError(f"an arena of {arena_size} bytes cannot hold {count} slots")
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    def acquire(self) -> int | None:
        """A free slot's index, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        """Give a slot back; releasing a slot twice is a bug and raises."""
        if slot in self._free or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        """Byte offset of a slot in its arena."""
        return slot * self.slot_size

    @property
    def free(self) -> int:
        """How many slots are free."""
        return len(self._free)
