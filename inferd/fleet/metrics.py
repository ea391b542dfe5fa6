"""The controller's own Prometheus metrics: one counter for every action, and what it sees of the nodes."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class FleetMetrics:
    """inferd_fleet_* on a registry of their own, served at /metrics by `serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.actions = Counter("inferd_fleet_actions", "Actions taken, by kind and outcome (done, refused, failed).",
                               ["action", "outcome"], registry=self.registry)
        self.scrape_failures = Counter("inferd_fleet_scrape_failures", "Pod metrics endpoints that could not be "
                                       "read.", registry=self.registry)
        self.ticks = Counter("inferd_fleet_ticks", "Times every pod was read and the rules applied.",
                             registry=self.registry)
        self.pods = Gauge("inferd_fleet_pods", "Inference pods the controller watches.", registry=self.registry)
        self.fragmentation = Gauge("inferd_fleet_node_fragmentation_ratio", "Reserved but unused GPU memory over "
                                   "reserved memory, over the inference pods of each node.", ["node"],
                                   registry=self.registry)

    def action(self, action: str, outcome: str) -> None:
        """Count one action."""
        self.actions.labels(action, outcome).inc()

    def nodes(self, fragmentation: Mapping[str, float]) -> None:
        """Replace the per-node fragmentation gauge with what was just measured."""
        self.fragmentation.clear()
        for node, ratio in fragmentation.items():
            self.fragmentation.labels(node).set(ratio)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics from a background thread."""
        start_http_server(port, host, registry=self.registry)
