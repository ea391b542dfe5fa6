"""What the fleet controller decides, as pure functions of what it has observed.

Nothing here talks to Kubernetes or to a pod: the controller feeds these
functions what it read and carries out what they return, and the simulation in
deploy/sim/ feeds them a simulated fleet. Both run this code unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LABEL_PREFIX = "inferd.io/"
FRAGMENTED_LABEL = LABEL_PREFIX + "gpu-fragmented"

# Kubernetes' rule for the name part of a label key and for a label value.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def version_label(model: str) -> str | None:
    """The pod label that names `model`'s live version, or None where the name cannot make a label key."""
    name = f"{model}-version"
    return LABEL_PREFIX + name if _LABEL_NAME.match(name) else None


@dataclass(frozen=True)
class PodView:
    """One inference pod as the controller last saw it.

    `live` maps each model to the version it serves (empty when its metrics could
    not be read: nothing is then decided about its labels). `reserved_bytes` is
    what the pod's GPU allocators hold, `unused_bytes` the part of it holding no
    tensor. `moving` is true while the pod is not ready or is being deleted.
    """

    name: str
    node: str
    labels: Mapping[str, str] = field(default_factory=dict)
    live: Mapping[str, str] = field(default_factory=dict)
    reserved_bytes: int = 0
    unused_bytes: int = 0
    scraped: bool = True
    moving: bool = False


def label_changes(pod: PodView) -> dict[str, str | None]:
    """The label patch that makes `pod`'s version labels say what it serves (None removes a label).

    Empty when they already do, or when the pod's metrics were not read: a pod
    that could not be asked keeps the labels it has.
    """
    if not pod.scraped:
        return {}
    wanted = {}
    for model, version in pod.live.items():
        key = version_label(model)
        if key is not None and _LABEL_VALUE.match(version):
            wanted[key] = version
    changes: dict[str, str | None] = {k: v for k, v in wanted.items() if pod.labels.get(k) != v}
    for key in pod.labels:
        if key.startswith(LABEL_PREFIX) and key.endswith("-version") and key not in wanted:
            changes[key] = None
    return changes


def node_fragmentation(pods: Iterable[PodView]) -> dict[str, float]:
    """Each node's share of reserved GPU memory that holds no tensor, over the inference pods on it."""
    reserved: dict[str, int] = {}
    unused: dict[str, int] = {}
    for pod in pods:
        reserved[pod.node] = reserved.get(pod.node, 0) + pod.reserved_bytes
        unused[pod.node] = unused.get(pod.node, 0) + pod.unused_bytes
    return {node: (unused[node] / total if total else 0.0) for node, total in reserved.items()}


@dataclass(frozen=True)
class Policy:
    """The fragmentation rule: over `threshold` for `hold_s`, trim; still over `trim_grace_s` later, evict.

    A node stranding less than `min_stranded_bytes` does not count as fragmented
    whatever its share: a restart costs a cold start, which a few MiB do not pay for.
    """

    threshold: float = 0.25
    hold_s: float = 300.0
    trim_grace_s: float = 120.0
    min_stranded_bytes: int = 2**30


@dataclass(frozen=True)
class Trim:
    """Ask these pods on a fragmented node to return their unused GPU memory."""

    node: str
    pods: tuple[str, ...]
    fragmentation: float


@dataclass(frozen=True)
class Evict:
    """Evict this pod (through the Eviction API, so the PodDisruptionBudget has its say)."""

    node: str
    pod: str
    fragmentation: float


@dataclass(frozen=True)
class LabelNode:
    """Set (or clear) the node label that draws models with small memory requests."""

    node: str
    fragmented: bool
    fragmentation: float


Action = Trim | Evict | LabelNode


@dataclass
class _NodeWatch:
    over_since: float
    trimmed_at: float | None = None


class FragmentationWatch:
    """The fragmentation rule over time, node by node; its state is when each node went over and was trimmed.

    `step` is called with what was observed at `now` and returns what to do.
    A node hosting pods none of which could be read keeps its state until they
    can. Trims are asked of every pod on a node, again at each step until the
    caller reports one delivered (`trimmed`). Evictions are one at a time
    across the fleet: none while a pod is `moving` (an earlier eviction's pod
    is still going or its replacement not yet ready), and the one chosen is the
    pod that strands the most memory on the node that strands the most. The
    caller reports a done eviction with `evicted`, so a refused one (the budget
    says no) is asked again at the next step.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._nodes: dict[str, _NodeWatch] = {}

    def step(self, now: float, pods: Sequence[PodView], labelled: Iterable[str]) -> list[Action]:
        """What to do at `now`, given the pods as observed and the nodes that carry the fragmented label."""
        policy = self.policy
        fragmentation = node_fragmentation(p for p in pods if p.scraped)
        stranded = _stranded(pods)
        hosting = {p.node for p in pods}
        labelled = set(labelled)
        actions: list[Action] = []
        due: list[str] = []
        for node in sorted(hosting | labelled | set(self._nodes)):
            if node in hosting and node not in fragmentation:
                continue  # not measured this time: neither over nor under
            ratio = fragmentation.get(node, 0.0)
            if ratio <= policy.threshold or stranded.get(node, 0) < policy.min_stranded_bytes:
                self._nodes.pop(node, None)
                if node in labelled:
                    actions.append(LabelNode(node, False, ratio))
                continue
            watch = self._nodes.setdefault(node, _NodeWatch(now))
            if now - watch.over_since < policy.hold_s:
                continue
            if node not in labelled:
                actions.append(LabelNode(node, True, ratio))
            if watch.trimmed_at is None:
                on_node = tuple(sorted(p.name for p in pods if p.node == node and p.scraped and p.unused_bytes))
                actions.append(Trim(node, on_node, ratio))
            elif now - watch.trimmed_at >= policy.trim_grace_s:
                due.append(node)
        if due and not any(p.moving for p in pods):
            node = max(due, key=lambda n: (stranded[n], n))
            pod = max((p for p in pods if p.node == node and p.scraped), key=lambda p: (p.unused_bytes, p.name))
            actions.append(Evict(node, pod.name, fragmentation[node]))
        return actions

    def trimmed(self, node: str, now: float) -> None:
        """A trim request reached a pod on `node` at `now`: the grace before an eviction starts."""
        watch = self._nodes.get(node)
        if watch is not None and watch.trimmed_at is None:
            watch.trimmed_at = now

    def evicted(self, node: str) -> None:
        """An eviction on `node` went through: the node starts over (held, trimmed, then evicted again)."""
        self._nodes.pop(node, None)


def _stranded(pods: Iterable[PodView]) -> dict[str, int]:
    """Unused reserved bytes per node, over the pods that were read."""
    found: dict[str, int] = {}
    for pod in pods:
        if pod.scraped:
            found[pod.node] = found.get(pod.node, 0) + pod.unused_bytes
    return found
