"""inferd-fleet in the simulation: it observes the pods, asks the decision functions, and does what they say.

The decision functions are inferd.fleet.decisions', imported and called
unchanged. What the controller would read from the API server and from each
pod's metrics is read here from the simulated fleet, and what it would patch
(pod labels, node labels), post (evictions) or annotate (trims) is done to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from deploy.sim.fleet import READY, Fleet, Model, Pod
from deploy.sim.memory import Memory
from inferd.fleet.decisions import (
    Evict,
    FragmentationWatch,
    LabelNode,
    PodView,
    Policy,
    Trim,
    label_changes,
)

GIB = 1 << 30


class Cluster(Protocol):
    """What the controller needs of the simulated cluster."""

    fleet: Fleet
    memory: Memory
    models: tuple[Model, ...]

    def all_pods(self) -> list[Pod]:
        """Every pod of the inferd Deployments, scheduled or not, in creation order."""
        ...

    def pod(self, name: str) -> Pod | None:
        """The pod of that name, if it still exists."""
        ...

    def evict(self, pod: Pod, now: float) -> bool:
        """Post an eviction; False where the PodDisruptionBudget refuses it."""
        ...


class Controller:
    """One reconcile a step: labels kept true, then the fragmentation rule."""

    def __init__(self, policy: Policy) -> None:
        self.watch = FragmentationWatch(policy)
        self.trims = 0
        self.evictions = 0
        self.refused = 0
        self._live: dict[tuple[int, str], Mapping[str, str]] = {}

    def reconcile(self, now: float, cluster: Cluster) -> None:
        """Observe the fleet at `now` and carry out what the decision functions return."""
        fleet = cluster.fleet
        views = self._observe(cluster)
        labelled = [fleet.names[i] for i in np.flatnonzero(fleet.fragmented)]
        for action in self.watch.step(now, views, labelled):
            if isinstance(action, Trim):
                for name in action.pods:
                    pod = cluster.pod(name)
                    if pod is not None and pod.slot >= 0:
                        cluster.memory.trim(pod.slot)
                        self.trims += 1
                        self.watch.trimmed(action.node, now)
            elif isinstance(action, Evict):
                pod = cluster.pod(action.pod)
                if pod is not None and cluster.evict(pod, now):
                    self.watch.evicted(action.node)
                    self.evictions += 1
                else:
                    self.refused += 1
            elif isinstance(action, LabelNode):
                fleet.fragmented[fleet.index[action.node]] = action.fragmented

    def _observe(self, cluster: Cluster) -> list[PodView]:
        """A PodView of every pod, as inferd.fleet.controller builds it; version labels patched as label_changes says.

        A pod not ready (pending, loading) or being deleted is not scraped and counts as moving; a
        ready one is scraped.
        """
        fleet, models, live = cluster.fleet, cluster.models, self._live
        reserved = (cluster.memory.reserved() * GIB).astype(np.int64).tolist()
        unused = (cluster.memory.unused() * GIB).astype(np.int64).tolist()
        names = fleet.names
        views = []
        for pod in cluster.all_pods():
            if pod.phase != READY:
                views.append(PodView(pod.name, names[pod.node] if pod.node >= 0 else "", pod.labels,
                                     scraped=False, moving=True))
                continue
            # One mapping per (model, version), shared by the views: they only read it.
            serving = live.get((pod.model, pod.version)) or live.setdefault(
                (pod.model, pod.version), {models[pod.model].name: pod.version})
            view = PodView(pod.name, names[pod.node], pod.labels, serving, reserved[pod.slot], unused[pod.slot])
            views.append(view)
            # label_changes depends only on the labels and what the pod serves, and the labels change
            # only here: a pod already reconciled for what it serves would get an empty patch (and one
            # not scraped gets none).
            if pod.labelled_for != pod.version:
                labels = dict(pod.labels)
                for key, value in label_changes(view).items():
                    if value is None:
                        labels.pop(key, None)
                    else:
                        labels[key] = value
                fleet.relabel(pod, labels)
                pod.labelled_for = pod.version
        return views
