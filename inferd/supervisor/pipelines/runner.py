"""Pipelines run: each request of a pipeline becomes a request per step, queued with its model's others (so it
batches with them), under the pipeline request's deadline and priority.

A step runs as soon as its inputs exist; its outputs come back from its batch's arena slot through replies.py
(`StepOf`), are copied once into this process's memory, and go into the next steps' requests, which the
dispatcher copies into their own batch's slot: no intermediate passes through a socket. A request is admitted
(or answered `overloaded`) at its first step, against its client's bounds, as a request to that model is
(displacing less urgent ones from a full queue); its later steps count against neither its client's bounds
nor `max_in_flight` again, nor is one displaced by a more urgent request; where the queue is full one waits
here for room, until its deadline. The first step that fails answers the request with its error, naming the
pipeline, the step, its model and version; the steps after it do not run, and those running beside it are
cancelled.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Hashable, Sequence

from inferd import protocol
from inferd.config.schema import Config
from inferd.errors import InvalidRequest
from inferd.protocol import Buffer, ReplyHeader, RequestId, TensorMeta, Timing
from inferd.supervisor.dispatch.replies import Replies, ReplyTo
from inferd.supervisor.pipelines.graph import Graph, Step, graphs
from inferd.supervisor.pipelines.runs import Run, StepTarget
from inferd.supervisor.queueing.queue import WAITING, QueuedRequest, RequestQueue, displaced_sentence
from inferd.supervisor.queueing.request_checks import check_against_model
from inferd.supervisor.shared.stats import Stats

log = logging.getLogger("inferd.pipelines")

CANCELLED_ERROR = "cancelled by its client; its later steps do not run"


class Pipelines:
    """Every pipeline's runs: started by the frontend, carried on by their steps' answers."""

    def __init__(self, config: Config, queue: RequestQueue, replies: Replies, stats: Stats) -> None:
        self.queue = queue
        self.replies = replies
        self.stats = stats
        self.runs: dict[tuple[Hashable, RequestId], Run] = {}  # by its client's connection and request id
        self.in_flight: Counter[str] = Counter()  # pipeline -> runs not answered yet
        self.blocked: deque[QueuedRequest] = deque()  # later steps' requests waiting for room in the queue
        self._numbers = itertools.count(1)
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take a new config (a SIGHUP): the pipelines as they are now; runs under way finish as they began."""
        self.config = config
        self.graphs: dict[str, Graph] = graphs(config.pipelines, config.models)

    def start(self, reply_to: ReplyTo, header: protocol.RequestHeader, buffers: Sequence[Buffer], now: float,
              deadline: float, priority: int) -> None:
        """Admit a checked request of a pipeline at its first step, or answer it `overloaded`."""
        graph = self.graphs[header.model]
        name = graph.name
        if self.in_flight[name] >= graph.config.max_in_flight:
            self._refuse(reply_to, header.id, name, protocol.OVERLOADED,
                         f"pipeline {name} has {graph.config.max_in_flight} requests in flight "
                         f"(pipelines.{name}.max_in_flight); retry later")
            return
        tensors = {spec.name: (meta, buffer) for spec, meta, buffer in zip(graph.config.inputs, header.inputs, buffers)}
        run = Run(next(self._numbers), graph, header.id, reply_to, reply_to.connection, now, deadline, priority,
                  tensors)
        first, *others = graph.ready(run.tensors, run.started)
        refused = self._put(run, first, now, run.client)
        if refused is not None:
            status, why = refused
            self._refuse(reply_to, header.id, name, status, f"pipeline {name}, step {first.title}: {why}")
            return
        key = (run.client, header.id)
        if key in self.runs:  # the client reused an id: the older run can no longer be cancelled by it
            log.debug("pipeline %s request %s: id reused while its earlier request runs", name, header.id)
        self.runs[key] = run
        self.in_flight[name] += 1
        for step in others:
            self._step(run, step, now)

    def _refuse(self, reply_to: ReplyTo, request_id: RequestId, name: str, status: str, error: str) -> None:
        self.replies.pipeline(reply_to, name, ReplyHeader(id=request_id, status=status, model=name, error=error), ())

    def _request(self, run: Run, step: Step, now: float, client: Hashable, first: bool) -> QueuedRequest:
        """The request of `step` for `run`, its inputs taken from the run's tensors (InvalidRequest if they are
        not what the step's model takes). Only the `first` step's, at which the run is admitted, may be displaced
        from the queue by a more urgent request, as a model's request may: the others were admitted with it."""
        metas = tuple(run.tensors[tensor][0] for tensor in step.takes)
        header = protocol.RequestHeader(id=run.request_id, model=step.model, inputs=metas, priority=run.priority)
        model = self.config.models[step.model]
        samples, shapes, _ = check_against_model(header, step.model, model)
        buffers: list[Buffer] = [run.tensors[tensor][1] for tensor in step.takes]
        return QueuedRequest(header, buffers, StepTarget(run, step, self._computed, self._failed),  # type: ignore[arg-type]
                             client, samples, sum(len(b) for b in buffers), now, run.deadline, run.priority,
                             shapes=shapes, displaceable=first)

    def _put(self, run: Run, step: Step, now: float, client: Hashable) -> tuple[str, str] | None:
        """Queue the first step's request, as a request to its model is queued (displacing less urgent ones from a
        full queue); the status and sentence it was refused with, if it was (`invalid` where its model cannot
        take the request's tensors, `overloaded` where the queue is full)."""
        try:
            request = self._request(run, step, now, client, first=True)
        except InvalidRequest as exc:
            return protocol.INVALID, exc.message
        refused, displaced = self.queue.admit(request)
        for victim in displaced:
            self.replies.error(victim, protocol.OVERLOADED, displaced_sentence(run.priority))
        if refused is not None:
            return protocol.OVERLOADED, self.queue.refusal_sentence(refused)
        run.started.add(step.index)
        run.active[step.index] = request
        return None

    def _step(self, run: Run, step: Step, now: float) -> None:
        """Queue a later step's request (or hold it here until the queue has room), unless the run's deadline
        has passed, or the run was answered already (a step beside it failed)."""
        if run.finished:
            return
        run.started.add(step.index)
        if now >= run.deadline:
            self._fail(run, step, protocol.TIMEOUT, "the deadline passed before the step could run", None)
            return
        try:
            request = self._request(run, step, now, run.key, first=False)
        except InvalidRequest as exc:
            # The client's tensors are the client's to mend; what earlier steps made, the pipeline's config.
            if all(tensor in run.graph.inputs.input_names() for tensor in step.takes):
                self._fail(run, step, protocol.INVALID, f"the tensors it was given do not fit its model: "
                           f"{exc.message}", None)
            else:
                self._fail(run, step, protocol.INTERNAL, f"the tensors the steps before it made do not fit its "
                           f"model: {exc.message}; the pipeline's steps disagree on them", None)
            return
        run.active[step.index] = request
        if self.blocked or self.queue.put(request) is not None:  # those that wait for room go first
            self.blocked.append(request)

    def retry(self, now: float) -> None:
        """Queue the later steps' requests that waited for room, in order, while it lasts; answer `timeout` the
        runs whose deadline passed while their step waited, wherever they are in line (one behind a step that
        cannot be queued yet is answered at its deadline too)."""
        if not self.blocked:
            return
        waiting: deque[QueuedRequest] = deque()
        for request in self.blocked:
            target: StepTarget = request.reply_to
            if target.run.finished:
                continue
            if request.deadline <= now:
                self._fail(target.run, target.step, protocol.TIMEOUT, (
                    f"the deadline passed while the step waited for room in the queue (queue.max_size "
                    f"{self.queue.bounds.max_size}, queue.max_bytes {self.queue.bounds.max_bytes})"), None)
                continue
            waiting.append(request)
        while waiting and self.queue.put(waiting[0]) is None:
            waiting.popleft()
        self.blocked = waiting

    def next_deadline(self) -> float:
        """The soonest deadline of a step's request waiting here for room (monotonic; inf if none)."""
        return min((r.deadline for r in self.blocked), default=math.inf)

    def _computed(self, target: StepTarget, outputs: tuple[TensorMeta, ...], frames: Sequence[Buffer], version: str,
                  wait_s: float, compute_s: float) -> None:
        run, step = target.run, target.step
        if run.finished:
            return
        del run.active[step.index]
        run.versions[step.index] = version
        run.wait_s += wait_s
        run.compute_s += compute_s
        series = self.stats.pipeline(run.graph.name).step(step.title)
        series.wait.add(wait_s)
        series.compute.add(compute_s)
        for index, tensor in step.makes:
            if index >= len(outputs):
                self._fail(run, step, protocol.INTERNAL, f"its model answered {len(outputs)} output(s), and the "
                           f"pipeline takes output {index} of it as tensor {tensor!r}", version)
                return
            # The one copy out of the slot, which is reused once this batch's replies have left.
            run.tensors[tensor] = (outputs[index], bytes(frames[index]))
        now = time.monotonic()
        for ready in run.graph.ready(run.tensors, run.started):
            self._step(run, ready, now)
            if run.finished:
                return
        if len(run.versions) == len(run.graph.steps):
            self._answer(run, now)

    def _failed(self, target: StepTarget, status: str, error: str, version: str) -> None:
        if not target.run.finished:
            target.run.active.pop(target.step.index, None)
            self._fail(target.run, target.step, status, error, version)

    def _answer(self, run: Run, now: float) -> None:
        """Send a run's outputs to its client."""
        self._finish(run)
        outputs = [run.tensors[tensor] for tensor in run.graph.config.outputs]
        header = ReplyHeader(id=run.request_id, status=protocol.OK, model=run.graph.name, version=run.version(),
                             outputs=tuple(meta for meta, _ in outputs),
                             timing_us=Timing(queue=int(run.wait_s * 1e6), compute=int(run.compute_s * 1e6),
                                              total=int((now - run.received) * 1e6)))
        self.replies.pipeline(run.reply_to, run.graph.name, header, [data for _, data in outputs], now - run.received,
                              run.samples)

    def _fail(self, run: Run, step: Step, status: str, error: str, version: str | None) -> None:
        """Answer a run with the error of `step` (of `version`, where one ran it); its other steps stop."""
        self._finish(run)
        model = f"{step.model} {version}" if version else step.model
        said = f"pipeline {run.graph.name}, step {step.title} (model {model}): {error}"
        log.info("request %s: %s", run.request_id, said)
        header = ReplyHeader(id=run.request_id, status=status, model=run.graph.name, version=run.version() or None,
                             error=said)
        self.replies.pipeline(run.reply_to, run.graph.name, header, ())

    def _finish(self, run: Run) -> None:
        """The run is answered: its steps still queued leave the queue, those running are dropped when back."""
        run.finished = True
        self.in_flight[run.graph.name] -= 1
        if self.runs.get((run.client, run.request_id)) is run:
            del self.runs[(run.client, run.request_id)]
        held = {id(request) for request in self.blocked}  # waiting here for room, not in the queue
        for request in run.active.values():
            if request.state == WAITING and id(request) not in held:
                self.queue.withdraw(request)
            request.cancelled = True
        run.active.clear()

    def cancel(self, client: Hashable, request_id: RequestId) -> bool:
        """A client's cancel of a pipeline request: answered `cancelled` now, its later steps never run. False
        when no run of that client has that id."""
        run = self.runs.get((client, request_id))
        if run is None:
            return False
        step = next((run.graph.steps[index] for index in sorted(run.active)), run.graph.steps[0])
        self._fail(run, step, protocol.CANCELLED, CANCELLED_ERROR, None)
        return True

    def stop(self, error: str) -> None:
        """Answer `unavailable` every run whose step waits here for room (a forced stop: those in the queue or
        running are answered as their steps' requests are)."""
        while self.blocked:
            target: StepTarget = self.blocked.popleft().reply_to
            if not target.run.finished:
                self._fail(target.run, target.step, protocol.UNAVAILABLE, error, None)

