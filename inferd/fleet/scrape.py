"""Read what a pod serves and how its GPU memory stands from its Prometheus endpoint."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


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
            if sample.name == "inferd_model_live" and sample.value == 1:
                live[sample.labels["model"]] = sample.labels["version"]
            elif sample.name == "inferd_gpu_memory_fragmentation_ratio":
                ratio[sample.labels["worker"]] = sample.value
            elif sample.name == "inferd_gpu_memory_reserved_bytes":
                reserved[sample.labels["worker"]] = sample.value
    unused = sum(ratio.get(worker, 0.0) * held for worker, held in reserved.items())
    return PodMetrics(live, int(sum(reserved.values())), int(unused))


def scrape(address: str, timeout_s: float) -> PodMetrics:
    """Fetch and parse http://ADDRESS/metrics; OSError (or ValueError on a page that is not metrics) on failure."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode("utf-8", errors="replace"))
