"""A batch in flight: the record the dispatcher makes as it sends a batch, and replies.py answers from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferd.ipc.messages import TensorRef
from inferd.models import unpad
from inferd.supervisor.dispatch.shadow import ShadowJob
from inferd.supervisor.processes.workers import ExecutorHandle
from inferd.supervisor.queueing.queue import QueuedRequest


@dataclass(eq=False)
class Batch:
    """A batch in flight: its requests, where it runs, and which slot holds it."""

    id: int
    model: str
    version: str
    requests: list[QueuedRequest]
    executor: ExecutorHandle
    slot: int
    started: float
    samples: int
    inputs: tuple[TensorRef, ...] = ()
    deadline: float = math.inf  # the soonest deadline of its requests not answered yet
    cuts: tuple[unpad.Cut, ...] = ()  # its outputs cut back to each request's size (its inputs were padded)
    elements: int | None = None  # input elements of each of its samples, where the model takes inputs of any size
    copy_for_shadow: bool = False  # a live batch the shadow candidate computes again once it is answered
    shadow_job: ShadowJob | None = None  # a shadow batch: that copy, computed again; nobody waits for it

    def describe(self) -> str:
        """How the log and error sentences name it."""
        return f"batch {self.id} of {self.model} {self.version}"
