"""deploy/kubernetes: valid against the Kubernetes schemas, consistent with one another and with inferd.

The PromQL of the autoscaling rules is checked, and run on made-up series, by
promtool where it is installed (.ci/run installs Prometheus).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inferd import config, paths
from inferd.cli import inferctl

KUBERNETES = "1.30.0"  # the oldest release still widely run; the manifests use nothing newer
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
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


def recorded_series() -> set[str]:
    return {rule["record"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}


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
        (series,) = [name for name in recorded if name in trigger["metadata"]["query"]]
        keda[series] = float(trigger["metadata"]["threshold"])
    assert {exposed[name]: target for name, target in hpa.items()} == keda == {
        "pod:inferd_queue_depth:sum": 50.0,
        "pod:inferd_gpu_utilization:min2m": 0.8,
        "pod:inferd_request_duration_seconds:p99_1m": 0.2,
    }
    hpa_behavior = manifest("HorizontalPodAutoscaler")["spec"]["behavior"]
    keda_behavior = manifest("ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert hpa_behavior == keda_behavior
    assert hpa_behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # no flapping


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: prometheus)")


@needs_promtool
def test_the_recording_rules_and_keda_queries_are_valid_promql(tmp_path):
    queries = [t["metadata"]["query"] for t in manifest("ScaledObject")["spec"]["triggers"]]
    keda_rules = tmp_path / "keda.yml"
    keda_rules.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": [
        {"record": f"keda:check_{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    done = subprocess.run(["promtool", "check", "rules", str(RULES), str(keda_rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_the_recording_rules_compute_the_signals(tmp_path):
    pod = 'namespace="inferd",pod="a"'
    bucket = "inferd_request_duration_seconds_bucket"
    other = 'namespace="inferd",pod="b"'
    cases = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [
                {"series": f'inferd_queue_depth{{{pod},model="mlp"}}', "values": "30x20"},
                {"series": f'inferd_queue_depth{{{pod},model="cnn"}}', "values": "40x20"},
                {"series": f'inferd_gpu_utilization_ratio{{{pod},device="cuda:0"}}', "values": "0.9x20"},
                {"series": f'inferd_gpu_utilization_ratio{{{other},device="cuda:0"}}', "values": "0.9x3 0.3 0.9x16"},
                # 90 % of requests under 100 ms, the rest under 500 ms.
                {"series": f'{bucket}{{{pod},model="mlp",le="0.1"}}', "values": "0+90x20"},
                {"series": f'{bucket}{{{pod},model="mlp",le="0.5"}}', "values": "0+100x20"},
                {"series": f'{bucket}{{{pod},model="mlp",le="+Inf"}}', "values": "0+100x20"},
            ],
            "promql_expr_test": [
                {"expr": "pod:inferd_queue_depth:sum", "eval_time": "2m",
                 "exp_samples": [{"labels": f"pod:inferd_queue_depth:sum{{{pod}}}", "value": 70}]},
                # At 2 minutes pod b's dip (at 45 s) is inside the window; at 4 minutes it is not.
                {"expr": "pod:inferd_gpu_utilization:min2m", "eval_time": "2m",
                 "exp_samples": [{"labels": f"pod:inferd_gpu_utilization:min2m{{{pod}}}", "value": 0.9},
                                 {"labels": f"pod:inferd_gpu_utilization:min2m{{{other}}}", "value": 0.3}]},
                {"expr": "pod:inferd_gpu_utilization:min2m", "eval_time": "4m",
                 "exp_samples": [{"labels": f"pod:inferd_gpu_utilization:min2m{{{pod}}}", "value": 0.9},
                                 {"labels": f"pod:inferd_gpu_utilization:min2m{{{other}}}", "value": 0.9}]},
                # 0.1 + 0.9 of the way from 0.1 to 0.5, rounded off the float noise.
                {"expr": "round(pod:inferd_request_duration_seconds:p99_1m, 0.001)", "eval_time": "3m",
                 "exp_samples": [{"labels": f"{{{pod}}}", "value": 0.46}]},
            ],
        }],
    }
    unit = tmp_path / "inferd-rules.test.yml"
    unit.write_text(yaml.safe_dump(cases))
    done = subprocess.run(["promtool", "test", "rules", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
