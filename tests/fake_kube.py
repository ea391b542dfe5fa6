"""An HTTP server that answers the Kubernetes API calls inferd-fleet makes, as the API server would.

There is no kube-apiserver on these machines. This one keeps pods, nodes and
PodDisruptionBudgets in memory and serves, over real HTTP to the real
Kubernetes client: list and watch of pods (resource versions, timeoutSeconds,
410 Gone for a version too old), merge patches of pods and nodes (415 for
any other patch type), node lists by label, and the Eviction API with the
budget's arithmetic (429 when it allows no disruption; an evicted pod gets a
deletionTimestamp, turns unready and is deleted a moment later), and field
selectors on the pod's phase. Every request
is recorded as (verb, resource, subresource, namespaced), so a test can hold
it against the controller's RBAC.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

POD_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?:/(?P<sub>eviction))?)?$")
NODE_PATH = re.compile(r"^/api/v1/nodes(?:/(?P<name>[^/]+))?$")
MERGE_PATCH = "application/merge-patch+json"
DELETE_AFTER_S = 0.3


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Equality and existence label selectors: `a=b,c!=d,e`."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


def kubeconfig(folder: Path, url: str) -> Path:
    """A kubeconfig that reaches the API at `url` without credentials."""
    path = folder / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    return path


def fields_select(selector: str, pod: dict[str, Any]) -> bool:
    """Field selectors on the pod's phase: `status.phase!=Failed,status.phase=Running`."""
    phase = pod["status"].get("phase")
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negated = "!=" in term
        field, value = term.split("!=" if negated else "=", 1)
        if field != "status.phase":
            raise ValueError(f"field label not supported: {field}")
        if (phase == value) == negated:
            return False
    return True


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeKube:
    """The cluster's state, and the server that exposes it."""

    def __init__(self, namespace: str = "inferd") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.budgets: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, str, bool]] = []  # verb, resource, subresource, namespaced
        self.evictions: list[str] = []
        self.on_deleted: Callable[[str], None] | None = None  # as a ReplicaSet would: make a replacement
        self.refused: list[str] = []
        self._version = 100
        self._events: list[tuple[int, str, dict[str, Any]]] = []
        self._oldest = 0  # watches from before this version get 410 Gone
        self._generation = 0  # bumped to end every open watch with 410 Gone
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- what a test does to the cluster ---------------------------------------------

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        with self._changed:
            self.nodes[name] = {"kind": "Node", "apiVersion": "v1",
                                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                                             "resourceVersion": self._bump()}}

    def add_pod(self, name: str, node: str, metrics: str | None, labels: dict[str, str] | None = None,
                ready: bool = True, phase: str = "Running") -> None:
        """A pod on `node` whose container port `metrics` is at `metrics` (host:port; None: no IP yet)."""
        host, port = metrics.rsplit(":", 1) if metrics else (None, "9464")
        pod = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": self.namespace, "uid": f"uid-{name}",
                         "labels": {"app.kubernetes.io/name": "inferd", **(labels or {})}},
            "spec": {"nodeName": node, "containers": [{"name": "inferd", "image": "inferd:0.1.0", "ports": [
                {"name": "data", "containerPort": 5555}, {"name": "metrics", "containerPort": int(port)}]}]},
            "status": {"phase": phase, "podIP": host, "conditions": []},
        }
        self._set_ready(pod, ready)
        with self._changed:
            self._store("ADDED", pod)

    def set_ready(self, name: str, ready: bool) -> None:
        with self._changed:
            pod = copy.deepcopy(self.pods[name])
            self._set_ready(pod, ready)
            self._store("MODIFIED", pod)

    def add_budget(self, name: str, selector: dict[str, str], expected: int, **limit: int) -> None:
        """A PodDisruptionBudget over `expected` pods with maxUnavailable or minAvailable."""
        with self._changed:
            self.budgets = [b for b in self.budgets if b["name"] != name]
            self.budgets.append({"name": name, "selector": selector, "expected": expected, **limit})

    def expire_watches(self) -> None:
        """Compact the event history: open watches end with 410 Gone, as do new ones from an earlier version."""
        with self._changed:
            self._oldest = self._version
            self._generation += 1
            self._events.clear()
            self._changed.notify_all()

    def labels(self, name: str) -> dict[str, str]:
        with self._changed:
            return dict(self.pods[name]["metadata"].get("labels", {})) if name in self.pods else {}

    def annotations(self, name: str) -> dict[str, str]:
        with self._changed:
            return dict(self.pods[name]["metadata"].get("annotations", {})) if name in self.pods else {}

    def node_labels(self, name: str) -> dict[str, str]:
        with self._changed:
            return dict(self.nodes[name]["metadata"]["labels"])

    @contextmanager
    def running(self) -> Iterator[FakeKube]:
        self._thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            with self._changed:
                self._generation += 1
                self._changed.notify_all()

    # -- the API's behaviour ---------------------------------------------------------

    def _bump(self) -> str:
        self._version += 1
        return str(self._version)

    @staticmethod
    def _set_ready(pod: dict[str, Any], ready: bool) -> None:
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    def _store(self, kind: str, pod: dict[str, Any]) -> None:
        pod["metadata"]["resourceVersion"] = self._bump()
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        self._events.append((self._version, kind, copy.deepcopy(pod)))
        self._changed.notify_all()

    def _healthy(self, pod: dict[str, Any]) -> bool:
        return (pod["metadata"].get("deletionTimestamp") is None
                and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"]))

    def _evict(self, name: str) -> tuple[int, dict[str, Any]]:
        with self._changed:
            pod = self.pods.get(name)
            if pod is None:
                return 404, status(404, "NotFound", f'pods "{name}" not found')
            labels = pod["metadata"]["labels"]
            for budget in self.budgets:
                if not all(labels.get(k) == v for k, v in budget["selector"].items()):
                    continue
                healthy = sum(1 for p in self.pods.values()
                              if self._healthy(p) and all(p["metadata"]["labels"].get(k) == v
                                                          for k, v in budget["selector"].items()))
                desired = (budget["expected"] - budget["maxUnavailable"] if "maxUnavailable" in budget
                           else budget["minAvailable"])
                if healthy - desired <= 0 and self._healthy(pod):
                    self.refused.append(name)
                    answer = status(429, "TooManyRequests",
                                    "Cannot evict pod as it would violate the pod's disruption budget.")
                    answer["details"] = {"causes": [{"reason": "DisruptionBudget", "message":
                                         f"The disruption budget {budget['name']} needs {desired} healthy pods "
                                         f"and has {healthy} currently"}]}
                    return 429, answer
            self.evictions.append(name)
            pod = copy.deepcopy(pod)
            pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._set_ready(pod, False)
            self._store("MODIFIED", pod)
        threading.Timer(DELETE_AFTER_S, self._finish_deletion, [name]).start()
        return 201, {"kind": "Eviction", "apiVersion": "policy/v1", "metadata": {"name": name}}

    def _finish_deletion(self, name: str) -> None:
        with self._changed:
            if name in self.pods:
                self._store("DELETED", copy.deepcopy(self.pods[name]))
        if self.on_deleted is not None:
            self.on_deleted(name)

    @staticmethod
    def _matches(query: dict[str, str], pod: dict[str, Any]) -> bool:
        return (selects(query.get("labelSelector", ""), pod["metadata"]["labels"])
                and fields_select(query.get("fieldSelector", ""), pod))

    def _list_pods(self, query: dict[str, str]) -> dict[str, Any]:
        with self._changed:
            items = [copy.deepcopy(p) for p in self.pods.values() if self._matches(query, p)]
            return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._version)},
                    "items": items}

    def _watch_pods(self, query: dict[str, str], write) -> None:
        since = int(query.get("resourceVersion") or self._version)
        with self._changed:
            matching = {name for name, p in self.pods.items() if self._matches(query, p)}
        deadline = time.monotonic() + float(query.get("timeoutSeconds", 1800))
        generation = self._generation
        while True:
            with self._changed:
                if since < self._oldest or generation != self._generation:
                    write({"type": "ERROR", "object": status(410, "Expired", f"too old resource version: {since}")})
                    return
                fresh = [(v, k, p) for v, k, p in self._events if v > since]
                if not fresh:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._changed.wait(min(left, 0.5))
                    continue
            for version, kind, pod in fresh:
                since = version
                name = pod["metadata"]["name"]
                if kind != "DELETED" and self._matches(query, pod):
                    write({"type": "MODIFIED" if name in matching else "ADDED", "object": pod})
                    matching.add(name)
                elif name in matching:  # deleted, or no longer selected: gone, as far as this watch knows
                    write({"type": "DELETED", "object": pod})
                    matching.discard(name)

    def _patch(self, store: dict[str, dict[str, Any]], name: str, body: Any, kind: str) -> tuple[int, Any]:
        with self._changed:
            if name not in store:
                return 404, status(404, "NotFound", f'{kind}s "{name}" not found')
            patched = merge_patch(store[name], body)
            if kind == "pod":
                self._store("MODIFIED", patched)
            else:
                patched["metadata"]["resourceVersion"] = self._bump()
                store[name] = patched
            return 200, copy.deepcopy(patched)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null")

            def _route(self, verb: str) -> None:
                parsed = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
                pod, node = POD_PATH.match(parsed.path), NODE_PATH.match(parsed.path)
                if pod and pod["ns"] != fake.namespace:
                    pod = None
                named = bool((pod or node) and (pod or node)["name"])
                if verb == "get" and query.get("watch") in ("true", "1"):
                    verb = "watch"
                elif verb == "get" and not named:
                    verb = "list"
                resource = "pods" if pod else "nodes" if node else parsed.path
                subresource = pod["sub"] or "" if pod else ""
                # Recorded as RBAC names the request's verb.
                fake.requests.append(({"post": "create", "put": "update"}.get(verb, verb), resource, subresource,
                                      bool(pod)))
                if verb == "patch" and self.headers.get("Content-Type") != MERGE_PATCH:
                    self._answer(415, status(415, "UnsupportedMediaType",
                                             f"the body of the request was in an unknown format: "
                                             f"{self.headers.get('Content-Type')}"))
                elif pod and verb == "list":
                    self._answer(200, fake._list_pods(query))
                elif pod and verb == "watch":
                    # Chunked, as the API server streams a watch: each event reaches the client as it happens.
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()

                    def write(event: dict[str, Any]) -> None:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()

                    try:
                        fake._watch_pods(query, write)
                        self.wfile.write(b"0\r\n\r\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    self.close_connection = True
                elif pod and verb == "patch" and pod["name"] and not subresource:
                    self._answer(*fake._patch(fake.pods, pod["name"], self._body(), "pod"))
                elif pod and verb == "post" and subresource == "eviction":
                    self._body()
                    self._answer(*fake._evict(pod["name"]))
                elif node and verb == "list":
                    selector = query.get("labelSelector", "")
                    with fake._changed:
                        items = [copy.deepcopy(n) for n in fake.nodes.values()
                                 if selects(selector, n["metadata"]["labels"])]
                        self._answer(200, {"kind": "NodeList", "apiVersion": "v1",
                                           "metadata": {"resourceVersion": str(fake._version)}, "items": items})
                elif node and verb == "patch" and node["name"]:
                    self._answer(*fake._patch(fake.nodes, node["name"], self._body(), "node"))
                else:
                    self._answer(404, status(404, "NotFound", f"the server could not find {verb} {parsed.path}"))

            def do_GET(self) -> None:
                self._route("get")

            def do_PATCH(self) -> None:
                self._route("patch")

            def do_POST(self) -> None:
                self._route("post")

            def do_PUT(self) -> None:
                self._route("put")

            def do_DELETE(self) -> None:
                self._route("delete")

        return Handler
