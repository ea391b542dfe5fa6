"""deploy/sim: the fleet simulation is reproducible, and it runs the controller's decision functions.

Small fleets and few simulated hours, so the whole file takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from deploy.sim import controller, run
from deploy.sim.engine import Scenario, simulate
from deploy.sim.fleet import EXCLUSIVE, SHARED
from deploy.sim.scheduler import Weights, manifest_weights, nodes_to_find
from inferd.fleet import decisions
from inferd.fleet.decisions import Policy

# Night traffic after a warm start: pods that ran up to a day hold fragmented memory.
FRAGMENTATION_PRONE = {"nodes": 16, "mode": SHARED, "hours": 2.0}
EAGER = Policy(threshold=0.15)
ROLLOUT = {"nodes": 16, "hours": 2.0, "rollout_hour": 0.5}


def weighing(affinity: int, spread: int | None = None) -> Weights:
    """The manifest's weights with this same-version affinity (and spread)."""
    manifest = manifest_weights()
    return dataclasses.replace(manifest, affinity=affinity, spread=manifest.spread if spread is None else spread)


@pytest.mark.parametrize("mode", [EXCLUSIVE, SHARED])
def test_the_same_seed_gives_the_same_figures(mode):
    scenario = Scenario(16, mode, True, seed=7, hours=2.0, rollout_hour=0.5)
    assert simulate(scenario) == simulate(scenario)


def test_another_seed_gives_other_figures():
    first = simulate(Scenario(16, SHARED, True, seed=1, hours=2.0))
    second = simulate(Scenario(16, SHARED, True, seed=2, hours=2.0))
    figures = ("stranded_mean_gib", "requests", "slo_over")
    assert [first[k] for k in figures] != [second[k] for k in figures]


def test_the_controller_evicts_and_strands_less_than_the_default_scheduler():
    default = simulate(Scenario(controller=False, **FRAGMENTATION_PRONE))
    fleet = simulate(Scenario(controller=True, policy=EAGER, **FRAGMENTATION_PRONE))
    assert default["pods_moved"] == default["pods_trimmed"] == 0
    assert fleet["pods_moved"] > 0
    assert fleet["pods_trimmed"] > 0
    assert fleet["stranded_mean_gib"] < default["stranded_mean_gib"]


def test_the_controller_goes_through_the_decision_functions(monkeypatch):
    calls = {"step": 0, "label_changes": 0}
    step, label_changes = decisions.FragmentationWatch.step, decisions.label_changes

    def counted_step(self, *args):
        calls["step"] += 1
        return step(self, *args)

    def counted_label_changes(pod):
        calls["label_changes"] += 1
        return label_changes(pod)

    monkeypatch.setattr(decisions.FragmentationWatch, "step", counted_step)
    monkeypatch.setattr(controller, "label_changes", counted_label_changes)
    figures = simulate(Scenario(controller=True, policy=EAGER, **FRAGMENTATION_PRONE))
    assert calls["step"] == 2 * 60  # one reconcile a step: 2 hours of 60 s steps
    assert calls["label_changes"] > 0
    assert figures["pods_moved"] > 0


def test_a_threshold_of_one_evicts_and_trims_nothing():
    figures = simulate(Scenario(controller=True, policy=Policy(threshold=1.0), **FRAGMENTATION_PRONE))
    assert figures["pods_moved"] == 0
    assert figures["pods_trimmed"] == 0


@pytest.mark.parametrize("mode", [EXCLUSIVE, SHARED])
def test_same_version_affinity_loads_no_more_than_none(mode):
    without = simulate(Scenario(mode=mode, controller=True, weights=weighing(0), **ROLLOUT))
    full = simulate(Scenario(mode=mode, controller=True, weights=weighing(100), **ROLLOUT))
    assert without["rollouts_done"] == full["rollouts_done"] == "6/6"
    assert full["rollout_loads"] <= without["rollout_loads"]


def test_without_the_spread_rule_affinity_loads_each_version_on_few_nodes():
    without = simulate(Scenario(mode=EXCLUSIVE, controller=True, weights=weighing(0, spread=0), **ROLLOUT))
    full = simulate(Scenario(mode=EXCLUSIVE, controller=True, weights=weighing(100, spread=0), **ROLLOUT))
    assert full["rollout_loads"] < without["rollout_loads"] / 2
    assert full["spread_pct"] > without["spread_pct"]


def test_the_default_scheduler_leaves_version_labels_absent():
    # Without the controller nothing labels the pods, so the affinity weight changes nothing.
    weighted = simulate(Scenario(mode=SHARED, controller=False, weights=weighing(100, spread=100), **ROLLOUT))
    unweighted = simulate(Scenario(mode=SHARED, controller=False, weights=weighing(0, spread=100), **ROLLOUT))
    assert weighted["rollout_loads"] == unweighted["rollout_loads"]
    assert weighted["slo_over"] == unweighted["slo_over"]


def test_weights_come_from_the_manifest_and_a_term_it_lacks_weighs_nothing(tmp_path: Path):
    manifest = tmp_path / "deployment.yaml"
    manifest.write_text("""
apiVersion: apps/v1
kind: Deployment
spec:
  template:
    spec:
      affinity:
        podAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 30
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    inferd.io/mlp-version: v1
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 70
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    app.kubernetes.io/name: inferd
""")
    weights = manifest_weights(manifest)
    assert (weights.affinity, weights.spread, weights.fragmented) == (30, 70, 0)
    assert "no term for fragmented" in weights.source


def test_a_scenario_runs_with_the_manifests_weights():
    assert Scenario(16, SHARED, True).weights == manifest_weights()


def test_nodes_scored_follow_the_schedulers_adaptive_percentage():
    assert [nodes_to_find(n) for n in (16, 99, 100, 256, 5000)] == [16, 99, 100, 122, 500]


def test_the_command_line_prints_a_json_line_per_scenario_then_the_table(capsys):
    assert run.main(["--nodes", "16", "--hours", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines[:4]]
    assert [(r["mode"], r["scenario"]) for r in rows] == [
        (EXCLUSIVE, "default scheduler"), (EXCLUSIVE, "inferd-fleet"),
        (SHARED, "default scheduler"), (SHARED, "inferd-fleet")]
    assert lines[4] == ""
    assert lines[5].split()[:3] == ["nodes", "mode", "scenario"]
    assert len(lines) == 10
    assert np.isfinite([r["stranded_mean_gib"] for r in rows]).all()
