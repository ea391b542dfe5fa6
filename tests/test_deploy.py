"""deploy/kubernetes and deploy/kserve: valid against the Kubernetes schemas, consistent with one another
and with inferd.

The PromQL of the autoscaling rules is checked, and run on made-up series, by
promtool where it is installed (.ci/run installs Prometheus). KServe's resources
have no schema here: their pod parts are checked as core v1 objects, the rest
against the fields KServe's API types declare.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import torch
import yaml

from inferd import config
from inferd.cli.daemon import inferd
from inferd.cli.inferctl import inferctl
from inferd.fleet.decisions import FRAGMENTED_LABEL, version_label
from inferd.fleet.main import fleet
from inferd.harness import DaemonProcess, free_port
from inferd.models import repository
from inferd.system import paths

KUBERNETES = "1.30.0"  # the oldest release still widely run; the manifests use nothing newer
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KSERVE = DEPLOY.parent / "kserve"
RULES = DEPLOY / "prometheus" / "inferd-rules.yml"


def load_manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.relative_to(DEPLOY)}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


MANIFESTS = load_manifests()


def manifest(kind: str, name: str = "inferd") -> dict[str, Any]:
    matches = [doc for _, doc in MANIFESTS if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}"
    return matches[0]


def daemon_config() -> dict[str, Any]:
    return tomllib.loads(manifest("ConfigMap", "inferd-config")["data"]["inferd.toml"])


def pod_spec() -> dict[str, Any]:
    return manifest("Deployment")["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (only,) = pod_spec()["containers"]
    return only


def keda_behavior_as_hpa(scaled: dict[str, Any]) -> dict[str, Any]:
    """The ScaledObject's HPA behavior inside a minimal HPA, so the Kubernetes schema can judge it."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "check"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inferd"},
                 "maxReplicas": scaled["spec"]["maxReplicaCount"],
                 "behavior": scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
    }


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[name for name, _ in MANIFESTS])
def test_every_manifest_is_valid(name, doc):
    if doc["apiVersion"].startswith("keda.sh/"):
        # No Kubernetes schema for KEDA's resource: its HPA part against the HPA schema,
        # the rest by shape.
        kubernetes_validate.validate(keda_behavior_as_hpa(doc), KUBERNETES, strict=True)
        spec = doc["spec"]
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert all(t["type"] == "prometheus" and set(t["metadata"]) >= {"serverAddress", "query", "threshold"}
                   for t in spec["triggers"])
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_does_catch_a_broken_manifest():
    broken = copy.deepcopy(manifest("Deployment"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 60  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_configmap_holds_a_valid_config_matching_the_pod():
    parsed = config.parse(daemon_config())
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert parsed.server.listen == (f"tcp://0.0.0.0:{ports['data']}",)
    assert parsed.server.metrics == f"0.0.0.0:{ports['metrics']}"
    # The probes run a bare `inferctl`, which looks in /run/inferd: the daemon must be there.
    assert parsed.server.control == f"ipc://{paths.SYSTEM_RUNTIME_DIR / paths.CONTROL_SOCKET_NAME}"
    mounts = {m["mountPath"] for m in container()["volumeMounts"]}
    assert {str(paths.SYSTEM_RUNTIME_DIR), parsed.server.state_dir, "/dev/shm", "/etc/inferd"} <= mounts
    assert all(model.repository.startswith("/models/") for model in parsed.models.values())


def test_the_pod_outlives_its_drain_and_has_room_for_its_arenas():
    parsed = config.parse(daemon_config())
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod_spec()["terminationGracePeriodSeconds"] > parsed.server.drain_timeout_s + int(pre_stop[1])
    shm = next(v for v in pod_spec()["volumes"] if v["name"] == "shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    limit_gib = float(shm["sizeLimit"].removesuffix("Gi"))
    assert limit_gib * 1024 >= 4 * parsed.workers.shm_mb  # four GPUs' workers


def test_probes_call_real_inferctl_commands_and_never_kill_a_warming_pod():
    probes = {kind: container()[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        command = probe["exec"]["command"]
        assert command[0] == "inferctl" and command[1] in inferctl.commands
    assert probes["readinessProbe"]["exec"]["command"][1] == "health"
    assert probes["livenessProbe"]["exec"]["command"][1] == "status"  # answers while warming or reloading
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "too little time to load and warm"


def test_services_budget_and_autoscalers_all_point_at_the_deployment():
    labels = manifest("Deployment")["spec"]["template"]["metadata"]["labels"]
    for name in ("inferd", "inferd-metrics"):
        assert manifest("Service", name)["spec"]["selector"].items() <= labels.items()
    assert manifest("Service")["spec"]["clusterIP"] == "None", "the data Service must be headless"
    assert manifest("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert manifest("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == "inferd"
    assert manifest("ScaledObject")["spec"]["scaleTargetRef"]["name"] == "inferd"
    assert manifest("NetworkPolicy")["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_the_pods_prefer_the_nodes_serving_the_version_the_configmap_pins():
    affinity = pod_spec()["affinity"]
    (same_version,) = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    pinned = {version_label(name): body["version"] for name, body in daemon_config()["models"].items()}
    assert same_version["podAffinityTerm"]["labelSelector"]["matchLabels"] == pinned
    assert same_version["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    (spread,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    # The scheduler counts a spread term twice (the new pod's and each existing pod's): below twice the spread's
    # weight, the same-version term only breaks ties (deploy/sim/README.md).
    assert same_version["weight"] >= 2 * spread["weight"]
    (fragmented,) = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert fragmented["preference"]["matchExpressions"] == [
        {"key": FRAGMENTED_LABEL, "operator": "In", "values": ["true"]}]


def fleet_container() -> dict[str, Any]:
    (only,) = manifest("Deployment", "inferd-fleet")["spec"]["template"]["spec"]["containers"]
    return only


def test_the_fleet_deployment_runs_inferd_fleet_on_the_inference_pods():
    spec = manifest("Deployment", "inferd-fleet")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate", "two controllers would both evict"
    assert fleet_container()["image"] == container()["image"]
    assert fleet_container()["command"] == ["inferd-fleet"]
    parsed = fleet.make_context("inferd-fleet", list(fleet_container()["args"])).params
    inferd_deployment = manifest("Deployment")
    assert parsed["namespace"] == inferd_deployment["metadata"]["namespace"]
    selector = dict(term.split("=") for term in parsed["selector"].split(","))
    assert selector == inferd_deployment["spec"]["selector"]["matchLabels"]
    assert (parsed["fragmentation_threshold"], parsed["hold"]) == (0.25, 300)  # the seed's rule
    ports = {p["name"]: p["containerPort"] for p in fleet_container()["ports"]}
    assert parsed["metrics_at"] == f"0.0.0.0:{ports['metrics']}"
    assert fleet_container()["livenessProbe"]["httpGet"]["port"] == "metrics"
    scraped = manifest("Service", "inferd-fleet-metrics")["spec"]
    assert scraped["selector"].items() <= manifest("Deployment", "inferd-fleet")["spec"]["template"]["metadata"][
        "labels"].items()
    assert scraped["ports"][0]["targetPort"] == "metrics" and scraped["ports"][0]["port"] == ports["metrics"]
    # The controller finds each pod's metrics by the port's name.
    daemon_port = int(daemon_config()["server"]["metrics"].rsplit(":")[1])
    assert {"name": "metrics", "containerPort": daemon_port} in container()["ports"]


def test_the_fleet_has_its_own_account_with_only_the_rights_it_uses():
    account = manifest("ServiceAccount", "inferd-fleet")
    pod = manifest("Deployment", "inferd-fleet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    for binding, role in (("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")):
        bound = manifest(binding, "inferd-fleet")
        assert bound["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role, "name": "inferd-fleet"}
        assert bound["subjects"] == [{"kind": "ServiceAccount", "name": "inferd-fleet",
                                      "namespace": account["metadata"]["namespace"]}]
    rights = {(verb, resource) for kind in ("Role", "ClusterRole") for rule in manifest(kind, "inferd-fleet")["rules"]
              for verb in rule["verbs"] for resource in rule["resources"]}
    assert rights == {("list", "pods"), ("watch", "pods"), ("patch", "pods"), ("create", "pods/eviction"),
                      ("list", "nodes"), ("patch", "nodes")}
    assert manifest("Role", "inferd-fleet")["metadata"]["namespace"] == manifest("Deployment")["metadata"]["namespace"]


def test_trim_requests_reach_the_daemon_through_the_downward_api():
    parsed = config.parse(daemon_config())
    volume = next(v for v in pod_spec()["volumes"] if "downwardAPI" in v)
    (item,) = volume["downwardAPI"]["items"]
    assert item["fieldRef"]["fieldPath"] == "metadata.annotations"
    mount = next(m for m in container()["volumeMounts"] if m["name"] == volume["name"])
    assert parsed.workers.trim_request_file == f"{mount['mountPath']}/{item['path']}"


def test_the_network_policy_lets_the_fleet_read_the_pods_metrics():
    metrics_port = int(daemon_config()["server"]["metrics"].rsplit(":")[1])
    (rule,) = [r for r in manifest("NetworkPolicy")["spec"]["ingress"] if r["ports"][0]["port"] == metrics_port]
    fleet_labels = manifest("Deployment", "inferd-fleet")["spec"]["template"]["metadata"]["labels"]
    assert any("namespaceSelector" not in peer and peer["podSelector"]["matchLabels"].items() <= fleet_labels.items()
               for peer in rule["from"])


def recorded_series() -> set[str]:
    return {rule["record"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
            if "record" in rule}


def quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def test_both_autoscalers_scale_on_the_same_recorded_signals_and_thresholds():
    recorded = recorded_series()
    adapter = yaml.safe_load(manifest("ConfigMap", "prometheus-adapter-inferd")["data"]["config.yaml"])
    exposed = {}
    for rule in adapter["rules"]:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert series in recorded
        exposed[rule["name"]["as"]] = series
    hpa = {m["pods"]["metric"]["name"]: quantity(m["pods"]["target"]["averageValue"])
           for m in manifest("HorizontalPodAutoscaler")["spec"]["metrics"]}
    keda = {}
    for trigger in manifest("ScaledObject")["spec"]["triggers"]:
        (series,) = [name for name in recorded if f"{name}{{" in trigger["metadata"]["query"]]
        keda[series] = float(trigger["metadata"]["threshold"])
    assert {exposed[name]: target for name, target in hpa.items()} == keda == {
        "pod:inferd_queue_depth:sum": 50.0,
        "pod:inferd_gpu_utilization:avg5m_held2m": 0.8,
        "pod:inferd_request_duration_seconds:p99_1m_held1m": 0.2,
    }
    hpa_behavior = manifest("HorizontalPodAutoscaler")["spec"]["behavior"]
    keda_behavior = manifest("ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert hpa_behavior == keda_behavior
    assert hpa_behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # no flapping
    # Up at once: the triggers' "held for" is in the recorded series, not in a window that would add to it.
    assert hpa_behavior["scaleUp"]["stabilizationWindowSeconds"] == 0


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: prometheus)")


@needs_promtool
def test_the_recording_rules_and_keda_queries_are_valid_promql(tmp_path):
    queries = [t["metadata"]["query"] for t in manifest("ScaledObject")["spec"]["triggers"]]
    keda_rules = tmp_path / "keda.yml"
    keda_rules.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": [
        {"record": f"keda:check_{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    done = subprocess.run(["promtool", "check", "rules", str(RULES), str(keda_rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def promtool_test(tmp_path: Path, input_series: list[dict[str, str]], exprs: list[dict[str, Any]],
                  alerts: list[dict[str, Any]]) -> None:
    """Run promtool's unit tests of the rules on `input_series` (15 s apart); fail with its output."""
    cases = {"rule_files": [str(RULES)], "evaluation_interval": "15s",
             "tests": [{"interval": "15s", "input_series": input_series, "promql_expr_test": exprs,
                        "alert_rule_test": alerts}]}
    unit = tmp_path / "inferd-rules.test.yml"
    unit.write_text(yaml.safe_dump(cases))
    done = subprocess.run(["promtool", "test", "rules", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def held(expr: str, at: str, pods: dict[str, float]) -> dict[str, Any]:
    """An expression test: each pod's value of `expr` at `at`, rounded to 0.001."""
    return {"expr": f"round({expr}, 0.001)", "eval_time": at,
            "exp_samples": [{"labels": f'{{namespace="inferd",pod="{pod}"}}', "value": value}
                            for pod, value in pods.items()]}


def firing(alert: str, at: str, pods: list[str]) -> dict[str, Any]:
    """An alert test: `alert` fires at `at` for `pods` and no other (its annotations as the rules say)."""
    (annotations,) = [rule.get("annotations", {}) for group in yaml.safe_load(RULES.read_text())["groups"]
                      for rule in group["rules"] if rule.get("alert") == alert]
    return {"eval_time": at, "alertname": alert,
            "exp_alerts": [{"exp_labels": {"namespace": "inferd", **({"pod": pod} if pod else {})},
                            "exp_annotations": annotations} for pod in pods]}


@needs_promtool
def test_the_gpu_trigger_fires_when_the_5_minute_average_held_over_80_percent_for_2_minutes(tmp_path):
    gpu = 'inferd_gpu_utilization_ratio{namespace="inferd",pod="%s",device="cuda:0"}'
    # From 10 m on, "steady" is at 1.0: its 5-minute average (21 samples, 15 s apart) is
    # 0.5 + k/42 with k samples at 1.0, over 0.8 from k = 13, i.e. from 13 m; held 2 m at 15 m.
    # "blip" is at 1.0 for 13 samples, then 0: its average is over 0.8 at 13 m only, (13 + 0.5 z) / 21
    # after z zeros. "spiky" alternates 1.0 and 0.5 (over 0.8 every other sample): its average
    # never passes 0.75.
    series = [{"series": gpu % "steady", "values": "0.5x39 1x60"},
              {"series": gpu % "blip", "values": "0.5x39 1x12 0x47"},
              {"series": gpu % "spiky", "values": "0.5x39 " + " ".join(["1 0.5"] * 30)}]
    promtool_test(tmp_path, series, [
        held("pod:inferd_gpu_utilization:avg5m", "13m", {"steady": 0.81, "blip": 0.81, "spiky": 0.667}),
        held("pod:inferd_gpu_utilization:avg5m_held2m", "14m45s", {"steady": 0.786, "blip": 0.643, "spiky": 0.643}),
        held("pod:inferd_gpu_utilization:avg5m_held2m", "15m", {"steady": 0.81, "blip": 0.619, "spiky": 0.667}),
    ], [firing("InferdGpuBusy", "14m45s", []), firing("InferdGpuBusy", "15m", ["steady"]),
        firing("InferdGpuBusy", "20m", ["steady"])])


@needs_promtool
def test_the_latency_trigger_fires_when_p99_held_over_200_ms_for_a_minute(tmp_path):
    bucket = 'inferd_request_duration_seconds_bucket{namespace="inferd",pod="%s",model="mlp",le="%s"}'
    # 100 requests each 15 s. "slow" puts 10 of them between 100 and 500 ms from 5 m on (its p99 over
    # a minute is then 0.46 s); "blip" does so for one 15-s step only, which a one-minute rate holds for
    # less than a minute.
    series = []
    for pod, fast in (("slow", "0+100x20 2000+90x40"), ("blip", "0+100x20 2000+90x1 2090+100x40")):
        series += [{"series": bucket % (pod, "0.1"), "values": fast},
                   {"series": bucket % (pod, "0.5"), "values": "0+100x61"},
                   {"series": bucket % (pod, "+Inf"), "values": "0+100x61"}]
    promtool_test(tmp_path, series, [
        held("pod:inferd_request_duration_seconds:p99_1m", "4m", {"slow": 0.099, "blip": 0.099}),
        held("pod:inferd_request_duration_seconds:p99_1m", "8m", {"slow": 0.46, "blip": 0.099}),
        held("pod:inferd_request_duration_seconds:p99_1m_held1m", "8m", {"slow": 0.46, "blip": 0.099}),
    ], [firing("InferdSlow", "5m30s", []), firing("InferdSlow", "8m", ["slow"]),
        firing("InferdSlow", "15m", ["slow"])])


@needs_promtool
def test_the_queue_trigger_fires_when_more_than_50_wait_per_pod(tmp_path):
    queue = 'inferd_queue_depth{namespace="inferd",pod="%s",model="%s"}'
    series = [{"series": queue % ("a", "mlp"), "values": "30x20"}, {"series": queue % ("a", "cnn"), "values": "40x20"},
              {"series": queue % ("b", "mlp"), "values": "20x10 40x10"}]
    # (70 + 20) / 2 pods = 45 until 2 m 30 s; from 2 m 45 s (70 + 40) / 2 = 55.
    promtool_test(tmp_path, series, [
        {"expr": "pod:inferd_queue_depth:sum", "eval_time": "2m",
         "exp_samples": [{"labels": 'pod:inferd_queue_depth:sum{namespace="inferd",pod="a"}', "value": 70},
                         {"labels": 'pod:inferd_queue_depth:sum{namespace="inferd",pod="b"}', "value": 20}]},
    ], [firing("InferdQueueDeep", "2m", []), firing("InferdQueueDeep", "3m", [""])])


# -- deploy/kserve -----------------------------------------------------------------------
# What KServe declares (kserve/kserve: pkg/apis/serving, pkg/constants, the storage initializer):
MODEL_MOUNT = "/mnt/models"  # where the storage initializer puts the storageUri
KSERVE_CONTAINER = "kserve-container"  # the runtime container an InferenceService's model is merged into
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}
RUNTIME_POD_FIELDS = ("containers", "volumes", "nodeSelector", "affinity", "tolerations", "imagePullSecrets",
                      "hostIPC")  # ServingRuntimePodSpec: these are a PodSpec's
RUNTIME_FIELDS = {*RUNTIME_POD_FIELDS, "labels", "annotations", "supportedModelFormats", "multiModel", "disabled",
                  "protocolVersions", "workerSpec", "grpcEndpoint", "grpcDataEndpoint", "httpDataEndpoint",
                  "replicas", "storageHelper", "builtInAdapter"}
MODEL_FORMAT_FIELDS = {"name": str, "version": str, "autoSelect": bool, "priority": int}
# predictor.model: these, and the fields of a Container.
MODEL_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}
# predictor: the model, these (ComponentExtensionSpec), and the fields of a PodSpec.
COMPONENT_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "containerConcurrency", "timeout",
                    "canaryTrafficPercent", "logger", "batcher", "labels", "annotations", "deploymentStrategy"}
STORAGE_SCHEMES = ("gs://", "s3://", "pvc://", "file://", "https://", "http://", "hdfs://", "webhdfs://", "oci://",
                   "hf://")
ISVC_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# Istio, in front of a RawDeployment, takes a Service port's protocol from its name.
PORT_NAME = re.compile(r"(http|grpc)(-[a-z0-9]+)*")
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds: a ServingRuntime cannot set it


def kserve_doc(kind: str) -> dict[str, Any]:
    (doc,) = [doc for path in sorted(KSERVE.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
              if doc and doc["kind"] == kind]
    return doc


RUNTIME = kserve_doc("ClusterServingRuntime")
ISVC = kserve_doc("InferenceService")


def runtime_container(runtime: dict[str, Any] = RUNTIME) -> dict[str, Any]:
    return next(c for c in runtime["spec"]["containers"] if c["name"] == KSERVE_CONTAINER)


def runtime_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    """The pod part of a ServingRuntime as a Pod, so the Kubernetes schema can judge it."""
    spec = runtime["spec"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": runtime["metadata"]["name"], "labels": spec.get("labels", {}),
                         "annotations": spec.get("annotations", {})},
            "spec": {key: spec[key] for key in RUNTIME_POD_FIELDS if key in spec}}


def predictor_pod(isvc: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime's pod with the InferenceService's predictor laid over it, as KServe merges them
    (a shallow merge: enough for the schema to judge every field the InferenceService adds)."""
    pod = copy.deepcopy(runtime_pod(runtime))
    predictor = isvc["spec"]["predictor"]
    pod["spec"].update({k: v for k, v in predictor.items() if k != "model" and k not in COMPONENT_FIELDS})
    container = next(c for c in pod["spec"]["containers"] if c["name"] == KSERVE_CONTAINER)
    container.update({k: v for k, v in predictor["model"].items() if k not in MODEL_FIELDS})
    return pod


def served_config() -> config.Config:
    """The config the runtime's container runs with: the template that the storageUri carries."""
    args = runtime_container()["args"]
    return config.load(KSERVE / Path(args[args.index("--config") + 1]).relative_to(MODEL_MOUNT))


def runtime_problems(runtime: dict[str, Any]) -> list[str]:
    """What KServe's ServingRuntime types would refuse or ignore, each as a sentence."""
    problems = []
    if (runtime["apiVersion"], runtime["kind"]) != ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"):
        problems.append("not a serving.kserve.io/v1alpha1 ClusterServingRuntime")
    if "namespace" in runtime["metadata"]:
        problems.append("metadata.namespace: a ClusterServingRuntime is cluster-scoped")
    spec = runtime["spec"]
    problems += [f"spec.{key}: not a ServingRuntime field" for key in sorted(set(spec) - RUNTIME_FIELDS)]
    for i, model_format in enumerate(spec.get("supportedModelFormats", [])):
        where = f"spec.supportedModelFormats[{i}]"
        if "name" not in model_format:
            problems.append(f"{where}.name: required")
        for key, value in model_format.items():
            kind = MODEL_FORMAT_FIELDS.get(key)
            if kind is None:
                problems.append(f"{where}.{key}: not a field")
            elif type(value) is not kind:  # `is`: a bool is an int to isinstance
                problems.append(f"{where}.{key}: not a {kind.__name__}")
        if model_format.get("priority", 1) < 1:
            problems.append(f"{where}.priority: at least 1")
        if "priority" in model_format and not model_format.get("autoSelect"):
            problems.append(f"{where}.priority: counts only with autoSelect")
    problems += [f"spec.protocolVersions: {v!r} is none of {sorted(PROTOCOLS)}"
                 for v in spec.get("protocolVersions", []) if v not in PROTOCOLS]
    if [c["name"] for c in spec["containers"]].count(KSERVE_CONTAINER) != 1:
        problems.append(f"spec.containers: needs one container named {KSERVE_CONTAINER}")
    return problems


def isvc_problems(isvc: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What KServe would refuse in an InferenceService on `runtime`, or place on another runtime."""
    problems = []
    if (isvc["apiVersion"], isvc["kind"]) != ("serving.kserve.io/v1beta1", "InferenceService"):
        problems.append("not a serving.kserve.io/v1beta1 InferenceService")
    if not ISVC_NAME.fullmatch(isvc["metadata"]["name"]):
        problems.append(f"metadata.name: does not match {ISVC_NAME.pattern}")
    model, spec = isvc["spec"]["predictor"]["model"], runtime["spec"]
    if model.get("runtime") != runtime["metadata"]["name"]:
        problems.append(f"model.runtime: not {runtime['metadata']['name']}")
    if model["modelFormat"]["name"] not in {f["name"] for f in spec["supportedModelFormats"]}:
        problems.append("model.modelFormat.name: not a format of the runtime")
    if model.get("protocolVersion") not in spec["protocolVersions"]:
        problems.append("model.protocolVersion: not a protocol of the runtime")
    if not model.get("storageUri", "").startswith(STORAGE_SCHEMES):
        problems.append(f"model.storageUri: none of {', '.join(STORAGE_SCHEMES)}")
    mode = isvc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode")
    if len(runtime_container(runtime)["ports"]) > 1 and mode != "RawDeployment":
        problems.append("serving.kserve.io/deploymentMode: Knative allows a container one port; needs RawDeployment")
    return problems


def set_at(doc: Any, path: tuple[str | int, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def test_the_kserve_runtime_and_inferenceservice_have_what_kserve_takes():
    assert runtime_problems(RUNTIME) == []
    assert isvc_problems(ISVC, RUNTIME) == []


@pytest.mark.parametrize("path,value,problem", [
    (("spec", "protocolVersions"), ["v2", "v3"], "'v3' is none of"),
    (("spec", "supportedModelFormats", 0, "priority"), 0, "at least 1"),
    (("spec", "supportedModelFormats", 0, "autoSelect"), "true", "not a bool"),
    (("spec", "supportedModelFormat"), [], "not a ServingRuntime field"),
    (("spec", "containers", 0, "name"), "inferd", KSERVE_CONTAINER),
    (("metadata", "namespace"), "inferd", "cluster-scoped"),
])
def test_the_runtime_check_catches_a_broken_runtime(path, value, problem):
    broken = copy.deepcopy(RUNTIME)
    set_at(broken, path, value)
    assert any(problem in p for p in runtime_problems(broken)), runtime_problems(broken)


@pytest.mark.parametrize("path,value,problem", [
    (("spec", "predictor", "model", "modelFormat", "name"), "onnx", "not a format"),
    (("spec", "predictor", "model", "protocolVersion"), "v1", "not a protocol"),
    (("spec", "predictor", "model", "storageUri"), "ftp://models/mlp", "storageUri"),
    (("metadata", "annotations", "serving.kserve.io/deploymentMode"), "Serverless", "one port"),
    (("metadata", "name"), "MLP", "metadata.name"),
])
def test_the_inferenceservice_check_catches_a_broken_inferenceservice(path, value, problem):
    broken = copy.deepcopy(ISVC)
    set_at(broken, path, value)
    assert any(problem in p for p in isvc_problems(broken, RUNTIME)), isvc_problems(broken, RUNTIME)


def test_the_runtime_and_predictor_pods_are_valid_core_v1_pods():
    kubernetes_validate.validate(runtime_pod(RUNTIME), KUBERNETES, strict=True)
    kubernetes_validate.validate(predictor_pod(ISVC, RUNTIME), KUBERNETES, strict=True)


def test_the_pod_check_catches_a_broken_runtime_or_predictor():
    broken = copy.deepcopy(RUNTIME)
    runtime_container(broken)["readinessProbe"]["httpGet"]["pth"] = "/v2/health/ready"  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(runtime_pod(broken), KUBERNETES, strict=True)
    misspelt = copy.deepcopy(ISVC)
    misspelt["spec"]["predictor"]["model"]["resource"] = {"limits": {"memory": "8Gi"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(predictor_pod(misspelt, RUNTIME), KUBERNETES, strict=True)


def test_the_runtime_container_is_the_deployments_image_user_and_lockdown():
    runtime, deployed = runtime_container(), container()
    assert runtime["image"] == deployed["image"]
    assert runtime["resources"] == deployed["resources"]
    pod_security = pod_spec()["securityContext"]
    # The Deployment sets the user and seccomp on the pod, which a ServingRuntime cannot.
    assert runtime["securityContext"] == {
        **deployed["securityContext"],
        **{key: pod_security[key] for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile")}}


def test_the_runtime_runs_inferd_on_the_config_the_storage_uri_carries():
    container = runtime_container()
    assert container["args"][:2] == ["serve", "--config"]
    assert "--config" in {opt for param in inferd.commands["serve"].params for opt in param.opts}
    config_path = container["args"][2]
    assert Path(config_path).parent == Path(MODEL_MOUNT)
    assert {"name": "INFERD_CONFIG", "value": config_path} in container["env"]  # inferctl in the pod finds it
    assert served_config().models, "the template parses with inferd's parser and names a model"
    assert all(model.repository == MODEL_MOUNT for model in served_config().models.values())
    assert ISVC["metadata"]["name"] in served_config().models, "clients call /v2/models/<InferenceService>"


def test_the_runtime_ports_and_probes_are_the_configs_front_ends():
    served = served_config()
    http, grpc = runtime_container()["ports"]  # KServe routes the Service's port 80 to the first
    assert served.server.http == f"0.0.0.0:{http['containerPort']}"
    assert served.server.grpc == f"0.0.0.0:{grpc['containerPort']}"
    assert PORT_NAME.fullmatch(http["name"]) and http["name"].startswith("http")
    assert PORT_NAME.fullmatch(grpc["name"]) and grpc["name"].startswith("grpc")
    probes = {kind: runtime_container()[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe",
                                                                       "livenessProbe")}
    assert all(probe["port"] == http["name"] for probe in probes.values())
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/v2/health/live"
    assert RUNTIME["spec"]["annotations"]["prometheus.kserve.io/port"] == served.server.metrics.rpartition(":")[2]


def test_the_runtime_mounts_what_the_config_writes_and_leaves_the_model_mount_to_kserve():
    served, container = served_config(), runtime_container()
    volumes = {volume["name"]: volume for volume in RUNTIME["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert set(mounts.values()) == set(volumes)
    # The root filesystem is read-only: the state, the control socket (where a bare inferctl looks)
    # and the arenas each need a volume.
    assert served.server.control == f"ipc://{paths.SYSTEM_RUNTIME_DIR / paths.CONTROL_SOCKET_NAME}"
    assert {str(paths.SYSTEM_RUNTIME_DIR), served.server.state_dir, "/dev/shm"} <= set(mounts)
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert float(shm["sizeLimit"].removesuffix("Gi")) * 1024 >= 4 * served.workers.shm_mb  # four GPUs' workers
    # KServe mounts the storageUri there: a volume of the runtime's at or above it would hide it.
    assert not any(path == MODEL_MOUNT or MODEL_MOUNT.startswith(path + "/") for path in mounts)


def test_the_example_reads_the_model_folder_of_the_kubernetes_model_volume():
    claim, _, folder = ISVC["spec"]["predictor"]["model"]["storageUri"].removeprefix("pvc://").partition("/")
    assert manifest("PersistentVolumeClaim", claim)["metadata"]["namespace"] == ISVC["metadata"]["namespace"]
    # The Deployment serves the same model from the same folder of that volume.
    volume = next(v["name"] for v in pod_spec()["volumes"]
                  if v.get("persistentVolumeClaim", {}).get("claimName") == claim)
    mount = next(m["mountPath"] for m in container()["volumeMounts"] if m["name"] == volume)
    assert config.parse(daemon_config()).models[ISVC["metadata"]["name"]].repository == f"{mount}/{folder}"


def test_the_predictor_pods_stay_out_of_the_deployments_selectors():
    # KServe labels the predictor pods with the InferenceService's and the runtime's labels.
    labels = {**RUNTIME["spec"].get("labels", {}), **ISVC["metadata"].get("labels", {})}
    selectors = [(name, doc["spec"].get("selector") or doc["spec"]["podSelector"]) for name, doc in MANIFESTS
                 if doc["kind"] in ("Service", "PodDisruptionBudget", "NetworkPolicy")
                 and doc["metadata"]["namespace"] == ISVC["metadata"]["namespace"]]
    assert selectors
    for name, selector in selectors:
        assert not selector.get("matchLabels", selector).items() <= labels.items(), f"{name} selects the pods"


def test_the_runtime_drains_within_the_default_grace_period():
    pre_stop = runtime_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # 5 s of room for the workers and the gateway to exit after the drain.
    assert int(pre_stop[1]) + served_config().server.drain_timeout_s + 5 <= DEFAULT_GRACE_S


def test_the_runtime_command_serves_a_storage_uri_laid_out_as_the_readme_says(tmp_path):
    """inferd on a folder laid out as the storageUri must be, with the template config: it finds the
    version, and the probe paths answer on the HTTP front end. Only what ties it to a pod changes:
    addresses and folders of this machine, one CPU worker, a smaller arena."""
    store = tmp_path / "models"  # stands for /mnt/models
    raw = tomllib.loads((KSERVE / "inferd.toml").read_text())
    ((name, model),) = raw["models"].items()
    (store / "v1").mkdir(parents=True)
    torch.jit.script(torch.nn.Linear(model["inputs"][0]["shape"][0], 4)).save(str(store / "v1" / "model.pt"))
    model["repository"] = str(store)
    raw["server"].update(http=f"127.0.0.1:{free_port()}", grpc=f"127.0.0.1:{free_port()}", metrics="",
                         listen=[f"tcp://127.0.0.1:{free_port()}"], control=f"ipc://{tmp_path}/control.sock",
                         state_dir=str(tmp_path / "state"))
    raw["workers"].update(devices=["cpu"], shm_mb=64)
    daemon = DaemonProcess(store, raw)  # writes store/inferd.toml, where the storageUri holds it
    try:
        daemon.start()
        assert daemon.status()["models"][name]["live_version"] == "v1" == repository.versions(store)[-1]
        http = raw["server"]["http"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = runtime_container()[kind]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://{http}{path}", timeout=5) as reply:
                assert reply.status == 200, f"{kind} {path}"
        with urllib.request.urlopen(f"http://{http}/v2/models/{name}/ready", timeout=5) as reply:
            assert reply.status == 200
    finally:
        daemon.kill_all()
