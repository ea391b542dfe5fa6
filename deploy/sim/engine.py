"""One scenario, step by step, and the figures it comes to.

Each step: pods finish loading or terminating; traffic moves and the
autoscaler sizes each model's Deployment; each Deployment creates or deletes
pods (its rolling update once the rollout begins: maxSurge 1, maxUnavailable
0); the scheduler places what is pending; ready pods serve, and their memory
drifts; in the inferd-fleet scenario the controller then reconciles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deploy.sim.controller import Controller
from deploy.sim.fleet import (
    CATALOG,
    GPU_GIB,
    GPUS_PER_NODE,
    LOADING,
    MODES,
    PENDING,
    READY,
    TERMINATING,
    VERSIONS,
    Fleet,
    Model,
    Pod,
    request_gib,
)
from deploy.sim.memory import Memory
from deploy.sim.scheduler import Scheduler, Weights, manifest_weights
from deploy.sim.traffic import PEAK_FILL, ROLLOUT_HOUR, Autoscaler, late_share, trace
from inferd.fleet.decisions import Policy, version_label

DEFAULT_SCHEDULER = "default scheduler"
INFERD_FLEET = "inferd-fleet"
TERMINATE_S = 35.0  # preStop 5 s and the drain; the pod's GPU memory stays held until it is gone
WARM_AGE_S = 24 * 3600.0  # the pods the simulation starts with have been running up to a day
STEP_S = 60.0  # the default step: hold_s and trim_grace_s are whole steps, and a default run stays under a minute
_PHASE_RANK = {PENDING: 0, LOADING: 1, READY: 2}  # which pods a ReplicaSet deletes first


@dataclass(frozen=True)
class Scenario:
    """What to simulate: the fleet, how pods use GPUs, whether inferd-fleet runs, and the knobs."""

    nodes: int
    mode: str
    controller: bool
    seed: int = 1
    hours: float = 24.0
    step_s: float = STEP_S
    weights: Weights = field(default_factory=manifest_weights)  # what the pods run with
    policy: Policy = field(default_factory=Policy)
    rollout_hour: float = ROLLOUT_HOUR

    @property
    def name(self) -> str:
        """The scenario's name in the output."""
        return INFERD_FLEET if self.controller else DEFAULT_SCHEDULER


def simulate(scenario: Scenario) -> dict[str, Any]:
    """Run `scenario` and return its figures (the same scenario gives the same figures)."""
    return Simulation(scenario).run()


class Simulation:
    """The simulated cluster of one scenario (the controller's view of it is deploy.sim.controller.Cluster)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.models: tuple[Model, ...] = CATALOG
        # The same streams in both scenarios, so that they meet the same traffic and the same draws.
        traffic_rng, scheduler_rng, self._rng = (
            np.random.default_rng(s)
            for s in np.random.SeedSequence([scenario.seed, scenario.nodes, MODES.index(scenario.mode)]).spawn(3))
        self.fleet = Fleet(scenario.nodes, [version_label(m.name) or "" for m in self.models])
        self.memory = Memory(scenario.nodes * GPUS_PER_NODE, self.models)
        self.scheduler = Scheduler(self.fleet, scenario.weights, scheduler_rng)
        self.controller = Controller(scenario.policy) if scenario.controller else None
        self._dt = scenario.step_s
        self._steps = round(scenario.hours * 3600 / self._dt)
        self._rates = trace(self.models, scenario.mode, scenario.nodes, self._steps, self._dt,
                            PEAK_FILL[scenario.mode], traffic_rng)
        self._request = [request_gib(m, scenario.mode) for m in self.models]
        self._rate = np.array([m.rate for m in self.models])
        self.autoscaler = Autoscaler(self.models, self._rates[0])

        self._pods: dict[str, Pod] = {}
        self._by_model: list[dict[str, Pod]] = [{} for _ in self.models]
        self._pending: list[Pod] = []
        self._loading: list[Pod] = []
        self._terminating: list[Pod] = []
        self._ready = np.zeros(len(self.models), dtype=np.int64)
        self._serial = 0
        self._version = [VERSIONS[0]] * len(self.models)  # each Deployment's template
        self._rolling_from: list[str | None] = [None] * len(self.models)
        self._rollout_start: float | None = None
        self._rollout_end: list[float | None] = [None] * len(self.models)

        self._stranded_sum = self._stranded_peak = self._idle_sum = 0.0
        self._requests = self._late = 0.0
        self._pending_steps = self._oom_steps = 0
        self._loads = self._starts = 0
        self._spread_sum, self._spread_steps = 0.0, 0

    # -- what the controller sees (deploy.sim.controller.Cluster) -----------------------------------

    def all_pods(self) -> list[Pod]:
        """Every pod, scheduled or not, in creation order."""
        return list(self._pods.values())

    def pod(self, name: str) -> Pod | None:
        """The pod of that name, if it still exists."""
        return self._pods.get(name)

    def evict(self, pod: Pod, now: float) -> bool:
        """Evict through the PodDisruptionBudget (maxUnavailable 1); False while that would leave fewer than
        replicas - 1 of the model's pods ready."""
        left = self._ready[pod.model] - (pod.phase == READY)
        if pod.phase == TERMINATING or left < self.autoscaler.replicas[pod.model] - 1:
            return False
        self._delete(pod, now)
        return True

    # -- the run --------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Every step of the scenario; its figures."""
        self._warm_start()
        rollout_step = round(self.scenario.rollout_hour * 3600 / self._dt)
        for step in range(self._steps):
            now = step * self._dt
            self._transitions(now)
            replicas = self.autoscaler.update(now, self._rates[step])
            if step == rollout_step:
                self._rollout_start = now
                for m in range(len(self.models)):
                    self._rolling_from[m], self._version[m] = self._version[m], VERSIONS[1]
            for m in range(len(self.models)):
                self._reconcile_deployment(m, now, int(replicas[m]))
            self._schedule(now)
            self._serve(self._rates[step])
            self._measure()
            if self.controller is not None:
                self.controller.reconcile(now, self)
        return self._figures()

    def _warm_start(self) -> None:
        """The fleet as it stood at midnight: each Deployment at its replica count, pods ready and aged."""
        wanted = self.autoscaler.replicas.copy()
        while wanted.any():
            for m in np.flatnonzero(wanted):
                self._create(int(m), 0.0)
                wanted[m] -= 1
        occupancy = self.memory.occupancy()
        for pod in self._pending:
            if self._bind(pod, occupancy, 0.0):
                # Aged before the next pod is placed, so that placement sees what this one holds.
                request = self._request[pod.model]
                age = float(self._rng.uniform(0, WARM_AGE_S))
                held = self.memory.age(pod.slot, age, GPU_GIB - occupancy[pod.gpu] + request)
                occupancy[pod.gpu] += max(0.0, held - request)
                pod.until = 0.0
        self._pending = [p for p in self._pending if p.phase == PENDING]
        self._transitions(0.0)

    def _transitions(self, now: float) -> None:
        still = []
        for pod in self._loading:
            if pod.until <= now:
                pod.phase = READY
                self.memory.mark_ready(pod.slot)
                self._ready[pod.model] += 1
            else:
                still.append(pod)
        self._loading = still
        still = []
        for pod in self._terminating:
            if pod.until <= now:
                self.fleet.unbind(pod, self._request[pod.model])
                self.memory.remove(pod.slot)
                self._forget(pod)
            else:
                still.append(pod)
        self._terminating = still

    def _reconcile_deployment(self, m: int, now: float, replicas: int) -> None:
        """What the Deployment controller does for model `m`: scale, and roll one pod at a time."""
        alive = [p for p in self._by_model[m].values() if p.phase != TERMINATING]
        old = self._rolling_from[m]
        if old is None:
            if len(alive) < replicas:
                for _ in range(replicas - len(alive)):
                    self._create(m, now)
            elif len(alive) > replicas:
                for pod in self._ranked(alive)[: len(alive) - replicas]:
                    self._delete(pod, now)
            return
        # maxUnavailable 0: an old pod goes only while the ready pods stay at the replica count;
        # old pods not ready count for nothing and go first.
        spare = sum(p.phase == READY for p in alive) - replicas
        olds = [p for p in alive if p.version == old]
        if spare > 0 or any(p.phase != READY for p in olds):
            kept = []
            for pod in self._ranked(olds):
                if pod.phase != READY:
                    self._delete(pod, now)
                elif spare > 0:
                    self._delete(pod, now)
                    spare -= 1
                else:
                    kept.append(pod)
            olds = kept
        news = [p for p in alive if p.version != old]
        if not olds:
            self._rolling_from[m] = None
            self._rollout_end[m] = now
        # maxSurge 1: one pod over the replica count.
        for _ in range(min(replicas + 1 - len(olds) - len(news), replicas - len(news))):
            self._create(m, now)
        if len(news) > replicas:
            for pod in self._ranked(news)[: len(news) - replicas]:
                self._delete(pod, now)

    def _ranked(self, pods: list[Pod]) -> list[Pod]:
        """Pods in the order a ReplicaSet deletes them: unscheduled, not ready, crowded nodes, youngest."""
        count = self.fleet.model_count
        return sorted(pods, key=lambda p: (_PHASE_RANK[p.phase], -count[p.node, p.model] if p.node >= 0 else 0,
                                           -p.created))

    def _create(self, m: int, now: float) -> None:
        self._serial += 1
        pod = Pod(f"{self.models[m].name}-{self._version[m]}-{self._serial:06d}", m, self._version[m], now)
        self._pods[pod.name] = self._by_model[m][pod.name] = pod
        self._pending.append(pod)

    def _delete(self, pod: Pod, now: float) -> None:
        if pod.phase == PENDING:
            self._pending.remove(pod)
            self._forget(pod)
            return
        if pod.phase == READY:
            self._ready[pod.model] -= 1
        else:
            self._loading.remove(pod)
        self.memory.stop(pod.slot)
        pod.phase, pod.until = TERMINATING, now + TERMINATE_S
        self._terminating.append(pod)

    def _forget(self, pod: Pod) -> None:
        del self._pods[pod.name], self._by_model[pod.model][pod.name]

    def _schedule(self, now: float) -> None:
        if not self._pending:
            return
        occupancy = self.memory.occupancy()
        smallest_refused = np.inf
        for pod in self._pending:
            # What did not fit this step, nor will anything as large: nothing has left since.
            if self._request[pod.model] < smallest_refused and not self._bind(pod, occupancy, now):
                smallest_refused = self._request[pod.model]
        self._pending = [p for p in self._pending if p.phase == PENDING]

    def _bind(self, pod: Pod, occupancy: np.ndarray, now: float) -> bool:
        model, request = self.models[pod.model], self._request[pod.model]
        placed = self.scheduler.place(occupancy, pod.model, model, pod.version, request)
        if placed is None:
            return False
        node, gpu = placed
        occupancy[gpu] += request
        cold = self.fleet.bind(pod, node, gpu, request)
        pod.slot = self.memory.add(pod.model, gpu, request)
        pod.phase, pod.until = LOADING, now + model.load_s(cold)
        self._loading.append(pod)
        if self._rolling_from[pod.model] is not None and pod.version == self._version[pod.model]:
            self._starts += 1
            self._loads += cold
        return True

    def _serve(self, rates: np.ndarray) -> None:
        """Ready pods take their model's requests, evenly; pending and loading pods take none."""
        ready = self._ready
        utilisation = np.where(ready > 0, rates / np.maximum(ready, 1) / self._rate, np.inf)
        moved, short = self.memory.drift(np.minimum(utilisation, 1.0), self._dt, self._rng)
        requests = rates * self._dt
        late = requests * late_share(utilisation, self._rate)
        # A pod out of memory answers the part of its requests it had no room for late (the allocator
        # frees its cache and retries, the batch is split): the pod's share of the model's requests,
        # times the share of its batches that did not fit.
        lost = np.bincount(self.memory.model[moved], weights=short, minlength=len(self.models))
        late += (requests - late) * lost / np.maximum(ready, 1)
        self._requests += float(requests.sum())
        self._late += float(late.sum())
        self._oom_steps += int(np.count_nonzero(short))

    def _measure(self) -> None:
        stranded = float(self.memory.unused().sum())
        self._stranded_sum += stranded
        self._stranded_peak = max(self._stranded_peak, stranded)
        self._idle_sum += float(self.memory.occupancy().sum() - self.memory.reserved().sum())
        self._pending_steps += len(self._pending)
        if self._rollout_start is not None:
            count = self.fleet.model_count
            total = count.sum(axis=0)
            self._spread_sum += float(np.mean(count.max(axis=0)[total > 0] / total[total > 0]))
            self._spread_steps += 1

    def _figures(self) -> dict[str, Any]:
        sc, minutes = self.scenario, self._dt / 60
        fleet_gib = sc.nodes * GPUS_PER_NODE * GPU_GIB
        mean = self._stranded_sum / self._steps
        start = self._rollout_start
        ended = [e for e in self._rollout_end if e is not None]
        controller = self.controller
        return {
            "nodes": sc.nodes, "mode": sc.mode, "scenario": sc.name, "seed": sc.seed, "hours": sc.hours,
            "step_s": sc.step_s,
            "weights": {"affinity": sc.weights.affinity, "spread": sc.weights.spread,
                        "fragmented": sc.weights.fragmented, "from": sc.weights.source},
            "stranded_mean_gib": round(mean, 1),
            "stranded_peak_gib": round(self._stranded_peak, 1),
            "stranded_pct": round(100 * mean / fleet_gib, 2),
            "rollout_loads": self._loads,
            "rollout_starts": self._starts,
            "idle_requested_pct": round(100 * self._idle_sum / self._steps / fleet_gib, 1),
            "rollouts_done": f"{len(ended)}/{len(self.models)}",
            "rollout_hours": (round((max(ended) - start) / 3600, 2)
                              if start is not None and len(ended) == len(self.models) else None),
            "requests": round(self._requests),
            "slo_over": round(self._late),
            "slo_over_pct": round(100 * self._late / self._requests, 3) if self._requests else 0.0,
            "pods_moved": controller.evictions if controller else 0,
            "evictions_refused": controller.refused if controller else 0,
            "pods_trimmed": controller.trims if controller else 0,
            "pending_pod_min": round(self._pending_steps * minutes),
            "oom_pod_min": round(self._oom_steps * minutes),
            "spread_pct": round(100 * self._spread_sum / self._spread_steps, 1) if self._spread_steps else None,
        }
