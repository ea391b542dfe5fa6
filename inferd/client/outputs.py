"""Outputs a call asks written into the caller's own arrays (`out=`): where each goes, bounded by its array, and
the check that each came back there, so that what the call gives is that array and nothing else."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from inferd import protocol
from inferd.client.call import Result
from inferd.client.inputs import Out
from inferd.client.shared_memory import SharedMemoryRegion
from inferd.errors import InvalidRequest


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype} {list(array.shape)} ({array.nbytes} bytes)"


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


class OutputTargets:
    """The places of a call's outputs (`places`, for the request) and the caller's arrays they are to land in."""

    def __init__(self, out: Out, regions: Iterable[SharedMemoryRegion]) -> None:
        """`out` as `Client.submit` takes it; ValueError where an array is not a contiguous view of one of
        `regions`."""
        self.places: list[protocol.OutputPlace | None] = []
        self.arrays: list[np.ndarray | None] = []
        if out is None:
            return
        for index, item in enumerate([out] if isinstance(out, (np.ndarray, protocol.OutputPlace)) else out):
            if item is None or isinstance(item, protocol.OutputPlace):
                self.places.append(item)
                self.arrays.append(None)
                continue
            self.places.append(self._place(index, item, regions))
            self.arrays.append(item)

    @staticmethod
    def _place(index: int, array: np.ndarray, regions: Iterable[SharedMemoryRegion]) -> protocol.OutputPlace:
        if not array.flags.c_contiguous:
            raise ValueError(f"out[{index}] is not contiguous, and an output is written as one run of bytes: give "
                             "a view as region.array(dtype, shape, offset) makes it")
        for region in regions:
            offset = region.locate(array)
            if offset is not None:
                # Bounded by the array: an output larger than it comes in the reply instead of running over
                # whatever the caller keeps after it in the region.
                return protocol.OutputPlace(region.name, offset, array.nbytes)
        raise ValueError(f"out[{index}] does not lie in a region this client registered")

    def deliver(self, result: Result) -> Result:
        """`result`, given the caller's own arrays as its outputs; or an InvalidRequest, as the call's outcome,
        where an output did not fit its array (it came in the reply instead) or is of another dtype or shape."""
        if not any(array is not None for array in self.arrays):
            return result

        def delivered(header: protocol.ReplyHeader, outputs: list[np.ndarray]) -> Any:
            given = list(outputs)
            for index, (array, output) in enumerate(zip(self.arrays, outputs)):
                if array is None:
                    continue
                if _address(output) != _address(array):
                    return InvalidRequest(f"output {index}, {_describe(output)}, does not fit out[{index}], "
                                          f"{_describe(array)}: it came in the reply, and nothing was written to "
                                          f"out[{index}]", header.id)
                if output.dtype != array.dtype or output.shape != array.shape:
                    return InvalidRequest(f"output {index}, {_describe(output)}, was written into out[{index}], "
                                          f"{_describe(array)}: give an out of the output's dtype and shape",
                                          header.id)
                given[index] = array
            return result(header, given)

        return delivered
