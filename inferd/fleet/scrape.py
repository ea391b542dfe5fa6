"""Read what a pod serves and how its GPU memory stands from its Prometheus endpoint."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Pods are reached directly: an HTTP_PROXY meant for the world outside must not carry these.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class PodMetrics:
    """The live version of each model, and the GPU allocators' reserved and unused bytes, summed over workers."""

    live: dict[str, str]
    reserved_bytes: int
    unused_bytes: int


def parse_metrics(text: str) -> PodMetrics:
    """PodMetrics from the text of an inferd /metrics page."""
    live: dict[str, str] = {}
    ratio: dict[str, float] = {}
    reserved: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "inferd_model_live" and sample.value == 1 and {"model", "version"} <= labels.keys():
                live[labels["model"]] = labels["version"]
            elif sample.name == "inferd_gpu_memory_fragmentation_ratio" and "worker" in labels:
                ratio[labels["worker"]] = sample.value
            elif sample.name == "inferd_gpu_memory_reserved_bytes" and "worker" in labels:
                reserved[labels["worker"]] = sample.value
    unused = sum(ratio.get(worker, 0.0) * held for worker, held in reserved.items())
    return PodMetrics(live, int(sum(reserved.values())), int(unused))


def scrape(address: str, timeout_s: float) -> PodMetrics:
    """Fetch and parse http://ADDRESS/metrics; OSError, http.client.HTTPException or ValueError on failure."""
    with _DIRECT.open(f"http://{address}/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode("utf-8", errors="replace"))
