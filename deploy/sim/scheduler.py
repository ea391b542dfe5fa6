"""The default kube-scheduler's behaviour for these pods: filter the nodes, score them, take the best.

Filter: a node with a GPU that has room for the pod's request (the whole GPU
where pods do not share). As the real scheduler does, it searches from a
rotating start and stops once it has found enough feasible nodes
(percentageOfNodesToScore left at its adaptive default: every node below 100,
48 % of them at 256). Scores, with the default plugin weights:

    InterPodAffinity  x2  preferred terms summed per node, min-max normalised to 0..100
    NodeAffinity      x2  weights of the matching preferred terms, normalised to 0..100 by the highest
    NodeResourcesFit  x1  LeastAllocated: the share of the node's GPU memory left once the pod is on it

The highest total wins; ties are drawn at random (seeded), as selectHost does.
Integer arithmetic throughout, as the scheduler's int64 scores truncate.
Within the node the pod takes the fullest GPU it fits on (a packing device
plugin, keeping room whole for large pods), which for whole-GPU pods is any
free one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from deploy.sim.fleet import GPU_GIB, GPUS_PER_NODE, VERSIONS, Fleet, Model
from inferd.fleet.decisions import FRAGMENTED_LABEL, LABEL_PREFIX

MANIFEST = Path(__file__).resolve().parent.parent / "kubernetes" / "deployment.yaml"

INTER_POD_AFFINITY, NODE_AFFINITY, NODE_RESOURCES_FIT = 2, 2, 1  # the default profile's plugin weights
MAX_NODE_SCORE = 100
NODE_GIB = GPUS_PER_NODE * GPU_GIB


@dataclass(frozen=True)
class Weights:
    """The preferred terms' weights: same-version podAffinity, the model's spread, the fragmented-node pull.

    0 is a term the pods do not have, as the scheduler scores it.
    """

    affinity: int
    spread: int
    fragmented: int
    source: str = "given"


def _selector_keys(term: dict[str, Any]) -> set[str]:
    selector = term.get("labelSelector") or {}
    return set(selector.get("matchLabels") or {}) | {e["key"] for e in selector.get("matchExpressions") or []}


def manifest_weights(path: Path = MANIFEST) -> Weights:
    """The weights deployment.yaml gives its preferred terms; 0 for each term it lacks (`source` says which)."""
    found: dict[str, int] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != "Deployment":
            continue
        affinity = doc["spec"]["template"]["spec"].get("affinity") or {}
        preferred = "preferredDuringSchedulingIgnoredDuringExecution"
        for term in (affinity.get("podAffinity") or {}).get(preferred) or []:
            keys = _selector_keys(term["podAffinityTerm"])
            if any(k.startswith(LABEL_PREFIX) and k.endswith("-version") for k in keys):
                found.setdefault("affinity", term["weight"])
        for term in (affinity.get("podAntiAffinity") or {}).get(preferred) or []:
            if term["podAffinityTerm"].get("topologyKey") == "kubernetes.io/hostname":
                found.setdefault("spread", term["weight"])
        for term in (affinity.get("nodeAffinity") or {}).get(preferred) or []:
            if any(e["key"] == FRAGMENTED_LABEL for e in term["preference"].get("matchExpressions") or []):
                found.setdefault("fragmented", term["weight"])
    missing = [name for name in ("affinity", "spread", "fragmented") if name not in found]
    source = f"{path.parent.name}/{path.name}"
    if missing:
        source += " (no term for " + ", ".join(missing) + ")"
    return Weights(**{name: found.get(name, 0) for name in ("affinity", "spread", "fragmented")}, source=source)


def nodes_to_find(nodes: int) -> int:
    """How many feasible nodes the scheduler looks for before scoring (numFeasibleNodesToFind)."""
    if nodes < 100:
        return nodes
    percentage = max(50 - nodes // 125, 5)
    return max(nodes * percentage // 100, 100)


class Scheduler:
    """Places one pod at a time on the fleet as the default scheduler would."""

    def __init__(self, fleet: Fleet, weights: Weights, rng: np.random.Generator) -> None:
        self.fleet = fleet
        self.weights = weights
        self.rng = rng
        self._start = 0  # nextStartNodeIndex
        self._find = nodes_to_find(fleet.nodes)

    def place(self, occupancy: np.ndarray, model_index: int, model: Model, version: str,
              request: int) -> tuple[int, int] | None:
        """The (node, fleet-wide GPU) for a pod of `model` at `version` needing `request` GiB; None: unschedulable.

        `occupancy` is each GPU's memory held, as Memory.occupancy gives it.
        """
        fleet, weights = self.fleet, self.weights
        fits = (GPU_GIB - occupancy.reshape(fleet.nodes, GPUS_PER_NODE)) >= request
        order = (np.arange(fleet.nodes) + self._start) % fleet.nodes
        hits = np.flatnonzero(np.count_nonzero(fits, axis=1)[order])
        if not hits.size:
            return None
        taken = hits[: self._find]
        self._start = (self._start + (int(taken[-1]) + 1 if hits.size >= self._find else fleet.nodes)) % fleet.nodes
        nodes = order[taken]

        # The pod's podAffinity term counts the pods on the node labelled with its version; its
        # anti-affinity term counts its model's pods, and so does each of those pods' own (identical)
        # term, matching the incoming pod: the plugin adds both, so the spread weighs twice. Their
        # podAffinity terms would count too, but the incoming pod has no version label: the controller
        # labels a pod only once it serves.
        raw = (weights.affinity * fleet.label_count[nodes, model_index, VERSIONS.index(version)]
               - 2 * weights.spread * fleet.model_count[nodes, model_index])
        low, high = raw.min(), raw.max()
        pod_affinity = (raw - low) * MAX_NODE_SCORE // (high - low) if high > low else np.zeros_like(raw)

        node_affinity = np.zeros_like(raw)
        if model.small and weights.fragmented:
            matched = weights.fragmented * fleet.fragmented[nodes].astype(np.int64)
            if matched.max() > 0:
                node_affinity = matched * MAX_NODE_SCORE // matched.max()

        least_allocated = (NODE_GIB - fleet.requested[nodes] - request) * MAX_NODE_SCORE // NODE_GIB

        total = INTER_POD_AFFINITY * pod_affinity + NODE_AFFINITY * node_affinity + NODE_RESOURCES_FIT * least_allocated
        best = np.flatnonzero(total == total.max())
        node = int(nodes[best[0] if best.size == 1 else best[self.rng.integers(best.size)]])

        free = GPU_GIB - occupancy[node * GPUS_PER_NODE:(node + 1) * GPUS_PER_NODE]
        gpu = int(np.argmin(np.where(free >= request, free, np.inf)))
        return node, node * GPUS_PER_NODE + gpu
