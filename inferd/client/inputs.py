"""What a caller passes as inputs (numpy arrays, or torch tensors on any device) as wire-ready arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd import protocol

Array = Any  # a numpy array, or a torch tensor on any device
# Where outputs go: an array (a view of a registered region) or an OutputPlace in one, one per output (None: in
# the reply).
Out = np.ndarray | protocol.OutputPlace | Sequence[np.ndarray | protocol.OutputPlace | None] | None


def as_numpy(value: Array) -> np.ndarray:
    """`value` as a numpy array the protocol can send."""
    if type(value).__module__.startswith("torch"):
        # Imported here, not above: a client whose caller has no torch never loads it, and one
        # handed a tensor has it loaded already.
        from inferd.arrays import to_numpy

        value = to_numpy(value.detach().cpu())
    return protocol.wire_array(np.asarray(value))


def as_inputs(inputs: Array | Sequence[Array]) -> list[np.ndarray | protocol.TensorMeta]:
    """A call's inputs (one array, or a list or tuple of them) as a list of arrays the protocol can send; a
    description of an input in a region (SharedMemoryRegion.put_bytes) as it is."""
    return [x if isinstance(x, protocol.TensorMeta) else as_numpy(x)
            for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
