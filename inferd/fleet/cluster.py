"""The Kubernetes API calls the fleet controller makes, and nothing else.

Each is one request through the official client: list and watch the inference
pods, merge-patch a pod's labels or annotations, evict a pod through the
Eviction API (so the PodDisruptionBudget decides), list and label nodes. The
RBAC in deploy/kubernetes/fleet/ grants exactly these.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client, config, watch

MERGE_PATCH = "application/merge-patch+json"
METRICS_PORT = "metrics"
# Pods that ended (evicted by the kubelet, refused at admission) stay in the API, never ready: left out,
# or they would hold every eviction back as pods still on their way.
RUNNING = "status.phase!=Failed,status.phase!=Succeeded"
# (connect, read) seconds: without a read timeout a half-open connection would hang the controller.
CALL_TIMEOUT = (5, 30)
WATCH_SLACK_S = 15
API_ERRORS = (client.ApiException, urllib3.exceptions.HTTPError, OSError)


@dataclass(frozen=True)
class PodRecord:
    """What the controller keeps of a pod: where it runs, where its metrics are, and its labels."""

    name: str
    node: str
    address: str | None  # host:port of its metrics endpoint, once it has an IP
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = False
    deleting: bool = False


def pod_record(pod: Any) -> PodRecord:
    """A PodRecord from the client's V1Pod."""
    port = next((p.container_port for c in pod.spec.containers for p in (c.ports or []) if p.name == METRICS_PORT),
                None)
    status = pod.status
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or [])) if status else False
    ip = status.pod_ip if status else None
    return PodRecord(
        name=pod.metadata.name,
        node=pod.spec.node_name or "",
        address=f"{ip}:{port}" if ip and port else None,
        labels=dict(pod.metadata.labels or {}),
        ready=ready,
        deleting=pod.metadata.deletion_timestamp is not None,
    )


class EvictionRefused(Exception):
    """The API would not evict the pod now (HTTP 429: its PodDisruptionBudget allows no disruption)."""


class Cluster:
    """The inference pods of one namespace (chosen by a label selector) and the cluster's nodes."""

    def __init__(self, namespace: str, selector: str, kubeconfig: str | None = None) -> None:
        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.selector = selector

    def list_pods(self) -> tuple[list[PodRecord], str]:
        """Every inference pod now, and the resource version to watch from."""
        listed: Any = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                                    field_selector=RUNNING, _request_timeout=CALL_TIMEOUT)
        return [pod_record(p) for p in listed.items], listed.metadata.resource_version

    def watch_pods(self, resource_version: str, timeout_s: int) -> Iterator[tuple[str, PodRecord | None, Any]]:
        """Pod events after `resource_version` for up to `timeout_s`: (type, record, raw object).

        An ERROR event (its record None) means the version is too old: list again.
        """
        stream = watch.Watch().stream(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                      field_selector=RUNNING, resource_version=resource_version,
                                      timeout_seconds=timeout_s, allow_watch_bookmarks=True,
                                      _request_timeout=(CALL_TIMEOUT[0], timeout_s + WATCH_SLACK_S))
        try:
            for event in stream:
                kind = event["type"]
                yield kind, pod_record(event["object"]) if kind != "BOOKMARK" else None, event["raw_object"]
        except client.ApiException as exc:
            # The client raises a watch's ERROR event (410 Gone: the version is too old) itself.
            if exc.status != 410:
                raise
            yield "ERROR", None, {"message": _reason(exc)}

    def patch_pod(self, name: str, labels: Mapping[str, str | None] | None = None,
                  annotations: Mapping[str, str | None] | None = None) -> None:
        """Merge-patch a pod's labels and annotations (a None value removes the key)."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": metadata}, _content_type=MERGE_PATCH,
                                       _request_timeout=CALL_TIMEOUT)

    def evict(self, name: str) -> None:
        """Evict a pod through the Eviction API; EvictionRefused when its budget allows no disruption now."""
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=self.namespace))
        try:
            self.core.create_namespaced_pod_eviction(name, self.namespace, body, _request_timeout=CALL_TIMEOUT)
        except client.ApiException as exc:
            if exc.status == 429:
                raise EvictionRefused(_reason(exc)) from None
            raise

    def labelled_nodes(self, label: str) -> set[str]:
        """The names of the nodes that carry `label`=true."""
        nodes: Any = self.core.list_node(label_selector=f"{label}=true", _request_timeout=CALL_TIMEOUT)
        return {n.metadata.name for n in nodes.items}

    def label_node(self, name: str, label: str, value: str | None) -> None:
        """Set a node label (None removes it)."""
        self.core.patch_node(name, {"metadata": {"labels": {label: value}}}, _content_type=MERGE_PATCH,
                             _request_timeout=CALL_TIMEOUT)


def _reason(exc: Any) -> str:
    """The Status message of an API error, or its reason line."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def describe_error(exc: Exception) -> str:
    """One line for an API or connection error."""
    if isinstance(exc, client.ApiException):
        return f"HTTP {exc.status}: {_reason(exc)}"
    return str(exc) or type(exc).__name__
