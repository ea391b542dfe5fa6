"""One request of a pipeline while it runs: its tensors so far, its steps' requests, and where each step's
answer goes."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from inferd.protocol import Buffer, RequestId, TensorMeta
from inferd.supervisor.dispatch.replies import ReplyTo
from inferd.supervisor.pipelines.graph import Graph, Step
from inferd.supervisor.queueing.queue import QueuedRequest


@dataclass(eq=False)
class Run:
    """A pipeline request admitted and not answered yet."""

    number: int  # the daemon's own, unique among runs
    graph: Graph
    request_id: RequestId
    reply_to: ReplyTo
    client: Hashable  # its client's connection (a cancel names it)
    received: float
    deadline: float
    priority: int
    tensors: dict[str, tuple[TensorMeta, Buffer]]  # each tensor made so far: the request's, and its steps'
    active: dict[int, QueuedRequest] = field(default_factory=dict)  # step -> its request, queued or running
    started: set[int] = field(default_factory=set)
    versions: dict[int, str] = field(default_factory=dict)  # step -> the version that computed it
    wait_s: float = 0.0  # its steps' time in their queues, summed
    compute_s: float = 0.0  # its steps' batches' compute time, summed
    finished: bool = False

    @property
    def key(self) -> tuple[str, int]:
        """What its later steps' requests count against in the queue's per-client bounds: the run itself, so
        that they never count again against its client's."""
        return ("pipeline", self.number)

    @property
    def samples(self) -> int:
        """The request's batch dim, which every step's request carries."""
        return next(iter(self.tensors.values()))[0].shape[0]

    def version(self) -> str:
        """Its steps' versions, as its reply's version says them: "decode:v2,resnet:v3,top5:v1"."""
        return ",".join(f"{step.title}:{self.versions[step.index]}" for step in self.graph.steps
                        if step.index in self.versions)


class StepTarget:
    """The reply_to of a step's request: its answer goes back to the pipeline (replies.StepOf)."""

    __slots__ = ("_computed", "_failed", "run", "step")

    def __init__(self, run: Run, step: Step,
                 computed: Callable[[StepTarget, tuple[TensorMeta, ...], Sequence[Buffer], str, float, float], None],
                 failed: Callable[[StepTarget, str, str, str], None]) -> None:
        self.run = run
        self.step = step
        self._computed = computed
        self._failed = failed

    def computed(self, request: QueuedRequest, outputs: tuple[TensorMeta, ...], frames: Sequence[Buffer],
                 version: str, wait_s: float, compute_s: float) -> None:
        """The step computed its request: on to the pipeline."""
        self._computed(self, outputs, frames, version, wait_s, compute_s)

    def failed(self, request: QueuedRequest, status: str, error: str, version: str) -> None:
        """The step answered its request with an error: on to the pipeline."""
        self._failed(self, status, error, version)
