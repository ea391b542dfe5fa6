"""The fleet controller's loop: follow the inference pods, and every interval decide and act.

Pods are listed once and then watched, so a pod that turns ready gets its
version labels at once; every `interval_s` each pod's metrics are read, the
labels made true, and the fragmentation rule stepped (decisions.py) and
carried out. Every action is one log line and one count in FleetMetrics.
"""

from __future__ import annotations

import dataclasses
import http.client
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from inferd.fleet.cluster import API_ERRORS, METRICS_PORT, Cluster, EvictionRefused, PodRecord, describe_error
from inferd.fleet.decisions import (
    FRAGMENTED_LABEL,
    Evict,
    FragmentationWatch,
    LabelNode,
    PodView,
    Policy,
    Trim,
    label_changes,
    node_fragmentation,
)
from inferd.fleet.metrics import FleetMetrics
from inferd.fleet.scrape import scrape
from inferd.supervisor.control.trim_requests import TRIM_ANNOTATION

log = logging.getLogger("inferd.fleet")

RETRY_S = 5.0
SCRAPERS = 16
SCRAPE_TIMEOUT_S = 5.0
# A pod's page can fail in many ways (refused, cut short, not metrics, missing labels): each is one pod unread.
SCRAPE_ERRORS = (OSError, ValueError, LookupError, http.client.HTTPException)


def _turned_ready(before: PodRecord | None, now: PodRecord) -> bool:
    return now.ready and not now.deleting and not (before is not None and before.ready and not before.deleting)


class Controller:
    """Keeps version labels true and applies the fragmentation rule to the pods `cluster` selects."""

    def __init__(self, cluster: Cluster, policy: Policy, metrics: FleetMetrics, interval_s: float) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.interval_s = interval_s
        self.watch = FragmentationWatch(policy)
        self.pods: dict[str, PodRecord] = {}
        self._unreadable: set[str] = set()
        # A fleet is thousands of pods; one slow or unreachable pod must not hold up the others.
        self._readers = ThreadPoolExecutor(SCRAPERS, thread_name_prefix="scrape")

    def run(self) -> None:
        """Follow and act until the process is stopped; API errors are logged and retried."""
        version: str | None = None
        next_tick = time.monotonic()
        while True:
            try:
                if version is None:
                    version = self._relist()
                remaining = next_tick - time.monotonic()
                if remaining > 0:
                    version = self._follow(version, remaining)
                    continue
                self.tick()
            except API_ERRORS as exc:
                log.warning("a Kubernetes API call failed: %s; listing again in %.0f s", describe_error(exc),
                            RETRY_S)
                version = None
                time.sleep(RETRY_S)
                continue
            next_tick = time.monotonic() + self.interval_s

    def tick(self) -> None:
        """Read every pod, make its labels true, and step and carry out the fragmentation rule."""
        views = self._read(list(self.pods.values()))
        self.metrics.pods.set(len(views))
        self.metrics.nodes(node_fragmentation(v for v in views if v.scraped))
        labelled = self.cluster.labelled_nodes(FRAGMENTED_LABEL)
        for action in self.watch.step(time.monotonic(), views, labelled):
            if isinstance(action, LabelNode):
                self._label_node(action)
            elif isinstance(action, Trim):
                self._trim(action)
            else:
                self._evict(action)
        self.metrics.ticks.inc()

    # -- following the pods --------------------------------------------------------

    def _relist(self) -> str:
        records, version = self.cluster.list_pods()
        before, self.pods = self.pods, {r.name: r for r in records}
        self._unreadable &= set(self.pods)
        # Pods that turned ready while no watch ran are labelled now, not at the next tick.
        self._read([r for r in records if _turned_ready(before.get(r.name), r)])
        return version

    def _follow(self, version: str, remaining: float) -> str | None:
        """Apply pod events until the stream ends; the version to go on from, or None to list again."""
        for kind, record, raw in self.cluster.watch_pods(version, max(1, round(remaining))):
            if kind == "ERROR":
                log.info("the pod watch expired (%s); listing again", raw.get("message", raw))
                return None
            version = raw["metadata"]["resourceVersion"]
            if record is None:
                continue
            if kind == "DELETED":
                self.pods.pop(record.name, None)
                self._unreadable.discard(record.name)
                continue
            before = self.pods.get(record.name)
            self.pods[record.name] = record
            if _turned_ready(before, record):
                self._read([record])  # labelled now, not at the next tick
        return version

    def _read(self, records: list[PodRecord]) -> list[PodView]:
        """Read these pods' metrics (16 at a time) and make their version labels true; what was read."""
        views = list(self._readers.map(self._view, records))
        for record, view in zip(records, views):
            self._label(record, view)
        return views

    def _view(self, record: PodRecord) -> PodView:
        if not record.ready or record.deleting:
            return PodView(record.name, record.node, record.labels, scraped=False, moving=True)
        try:
            if record.address is None:
                raise LookupError(f"it declares no container port named {METRICS_PORT!r}")
            found = scrape(record.address, SCRAPE_TIMEOUT_S)
        except SCRAPE_ERRORS as exc:
            self.metrics.scrape_failures.inc()
            if record.name not in self._unreadable:
                log.warning("cannot read the metrics of pod %s at %s: %s", record.name, record.address, exc)
                self._unreadable.add(record.name)
            return PodView(record.name, record.node, record.labels, scraped=False)
        if record.name in self._unreadable:
            log.info("the metrics of pod %s can be read again", record.name)
            self._unreadable.discard(record.name)
        return PodView(record.name, record.node, record.labels, found.live, found.reserved_bytes, found.unused_bytes)

    # -- actions -------------------------------------------------------------------

    def _label(self, record: PodRecord, view: PodView) -> None:
        changes = label_changes(view)
        if not changes:
            return
        said = ", ".join(f"{k}={v}" if v is not None else f"-{k}" for k, v in sorted(changes.items()))
        try:
            self.cluster.patch_pod(record.name, labels=changes)
        except API_ERRORS as exc:  # one pod's patch failing must not stop the others
            log.warning("cannot label pod %s (%s): %s", record.name, said, describe_error(exc))
            self.metrics.action("label_pod", "failed")
            return
        log.info("labelled pod %s: %s", record.name, said)
        self.metrics.action("label_pod", "done")
        labels = {k: v for k, v in {**record.labels, **changes}.items() if v is not None}
        self.pods[record.name] = dataclasses.replace(record, labels=labels)

    def _label_node(self, action: LabelNode) -> None:
        kind = "label_node" if action.fragmented else "unlabel_node"
        try:
            self.cluster.label_node(action.node, FRAGMENTED_LABEL, "true" if action.fragmented else None)
        except API_ERRORS as exc:  # asked again at the next tick
            log.warning("cannot %s node %s: %s", kind.replace("_", " "), action.node, describe_error(exc))
            self.metrics.action(kind, "failed")
            return
        if action.fragmented:
            log.info("node %s is fragmented (%.0f%% of reserved GPU memory unused): labelled %s=true",
                     action.node, action.fragmentation * 100, FRAGMENTED_LABEL)
        else:
            log.info("node %s is no longer fragmented (%.0f%%): removed %s", action.node,
                     action.fragmentation * 100, FRAGMENTED_LABEL)
        self.metrics.action(kind, "done")

    def _trim(self, action: Trim) -> None:
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pod in action.pods:
            try:
                self.cluster.patch_pod(pod, annotations={TRIM_ANNOTATION: stamp})
            except API_ERRORS as exc:  # asked again at the next tick
                log.warning("cannot ask pod %s to trim: %s", pod, describe_error(exc))
                self.metrics.action("trim", "failed")
                continue
            log.info("node %s is %.0f%% fragmented: asked pod %s to trim (%s=%s)", action.node,
                     action.fragmentation * 100, pod, TRIM_ANNOTATION, stamp)
            self.metrics.action("trim", "done")
            self.watch.trimmed(action.node, time.monotonic())

    def _evict(self, action: Evict) -> None:
        try:
            self.cluster.evict(action.pod)
        except EvictionRefused as exc:
            log.info("eviction of pod %s refused (node %s %.0f%% fragmented): %s", action.pod, action.node,
                     action.fragmentation * 100, exc)
            self.metrics.action("evict", "refused")
            return
        except API_ERRORS as exc:  # asked again at the next tick
            log.warning("cannot evict pod %s: %s", action.pod, describe_error(exc))
            self.metrics.action("evict", "failed")
            return
        log.info("node %s is still %.0f%% fragmented after a trim: evicted pod %s to restart clean", action.node,
                 action.fragmentation * 100, action.pod)
        self.metrics.action("evict", "done")
        self.watch.evicted(action.node)
