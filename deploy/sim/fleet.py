"""The fleet: nodes of 8 GPUs, the models they serve, and the pods that serve them.

`Fleet` also keeps, per node, the counts the scheduler scores from (pods of each
model, pods carrying each version label, GPU memory requested and held) so that
a scheduling decision costs a few array operations however many pods there are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GPUS_PER_NODE = 8
GPU_GIB = 80
VERSIONS = ("v1", "v2")  # every model serves v1 and rolls out v2

# A model whose request is at most this is "small": it prefers the nodes labelled fragmented.
SMALL_REQUEST_GIB = 8

EXCLUSIVE = "exclusive"  # one pod per GPU (nvidia.com/gpu: 1)
SHARED = "shared"  # pods packed onto GPUs by memory (time-slicing, MPS)
MODES = (EXCLUSIVE, SHARED)

PENDING, LOADING, READY, TERMINATING = "pending", "loading", "ready", "terminating"


@dataclass(frozen=True)
class Model:
    """One model: its memory, its speed and its part of the fleet.

    `workspace_gib` is what a full batch's activations take beside the weights;
    varied batch shapes can leave up to `frag_cap_gib` of it fragmented.
    `share` is the model's part of the fleet's pods at peak traffic.
    """

    name: str
    weights_gib: int
    workspace_gib: int
    frag_cap_gib: float
    service_ms: float
    share: float

    @property
    def request_gib(self) -> int:
        """GPU memory the pod asks for where GPUs are shared: weights and a full batch, no fragmentation."""
        return self.weights_gib + self.workspace_gib

    @property
    def rate(self) -> float:
        """Requests a second one ready pod serves at full utilisation."""
        return 1000.0 / self.service_ms

    @property
    def small(self) -> bool:
        """Whether the pod template carries the preference for nodes labelled fragmented."""
        return self.request_gib <= SMALL_REQUEST_GIB

    def load_s(self, cold: bool) -> float:
        """Seconds from bind to ready: fetch (cold, from the volume) or page cache (warm), then warm-up."""
        return 10.0 + self.weights_gib * (3.0 if cold else 0.5)


# Two models of each size; the large ones are most of the fleet, as in LLM serving.
CATALOG = (
    Model("mlp", 2, 4, 2.0, 4.0, 0.10),
    Model("cnn", 2, 4, 2.0, 5.0, 0.10),
    Model("ranker", 10, 6, 3.0, 8.0, 0.20),
    Model("encoder", 10, 6, 3.0, 10.0, 0.20),
    Model("llm", 35, 6, 3.0, 12.0, 0.20),
    Model("coder", 35, 6, 3.0, 12.5, 0.20),
)


def request_gib(model: Model, mode: str) -> int:
    """What the scheduler reserves on one GPU for a pod of `model`: the whole GPU when pods do not share."""
    return GPU_GIB if mode == EXCLUSIVE else model.request_gib


@dataclass(eq=False)
class Pod:
    """One pod of a model's Deployment; `version` is its template's (what it serves, and its affinity term)."""

    name: str
    model: int
    version: str
    created: float
    phase: str = PENDING
    node: int = -1
    gpu: int = -1  # fleet-wide GPU index
    slot: int = -1  # its row in Memory
    until: float = 0.0  # when loading or terminating ends
    labels: dict[str, str] = field(default_factory=dict)
    labelled_for: str | None = None  # the live version its labels were last reconciled against


class Fleet:
    """Nodes and what the scheduler needs to know of them."""

    def __init__(self, nodes: int, label_keys: list[str]) -> None:
        models = len(label_keys)
        self.nodes = nodes
        self.label_keys = label_keys  # each model's version label, the key its podAffinity term selects on
        self.names = [f"node-{i:03d}" for i in range(nodes)]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.model_count = np.zeros((nodes, models), dtype=np.int64)
        self.label_count = np.zeros((nodes, models, len(VERSIONS)), dtype=np.int64)
        self.requested = np.zeros(nodes, dtype=np.int64)
        self.fragmented = np.zeros(nodes, dtype=bool)
        self.cached = np.zeros((nodes, models, len(VERSIONS)), dtype=bool)

    def bind(self, pod: Pod, node: int, gpu: int, request: int) -> bool:
        """Count `pod` on `node`; True where the node had to fetch its model version (a cold load)."""
        pod.node, pod.gpu = node, gpu
        self.model_count[node, pod.model] += 1
        self.requested[node] += request
        version = VERSIONS.index(pod.version)
        cold = not self.cached[node, pod.model, version]
        self.cached[node, pod.model, version] = True
        return cold

    def unbind(self, pod: Pod, request: int) -> None:
        """`pod` has left its node."""
        self.model_count[pod.node, pod.model] -= 1
        self.requested[pod.node] -= request
        self.relabel(pod, {})

    def relabel(self, pod: Pod, labels: dict[str, str]) -> None:
        """Give a bound pod new labels, keeping the per-node version-label counts true."""
        key = self.label_keys[pod.model]
        if pod.labels.get(key) in VERSIONS:
            self.label_count[pod.node, pod.model, VERSIONS.index(pod.labels[key])] -= 1
        pod.labels = labels
        if labels.get(key) in VERSIONS:
            self.label_count[pod.node, pod.model, VERSIONS.index(labels[key])] += 1
