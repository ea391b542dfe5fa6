"""inferd-fleet: its decisions as pure functions, and the real controller process against an API that
behaves like Kubernetes' (tests/fake_kube.py) and real inferd daemons.

A CPU daemon reports no GPU memory, so where fragmentation is tested the pods'
metrics pages are stand-ins serving the metrics a GPU daemon writes; the
version labels come from real daemons' pages.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import RELOAD_MLP, Daemon, base_config, wait_for
from fake_kube import FakeKube, kubeconfig
from prometheus_client.parser import text_string_to_metric_families

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
    version_label,
)
from inferd.fleet.scrape import parse_metrics
from inferd.harness import free_port
from inferd.supervisor.control.trim_requests import TRIM_ANNOTATION, TrimRequests, parse_annotations

GIB = 2**30
FLEET = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "fleet"

# -- labels ------------------------------------------------------------------------------


def test_labels_follow_what_the_pod_serves():
    pod = PodView("p", "n", labels={"app": "inferd", "inferd.io/mlp-version": "v1", "inferd.io/old-version": "v3"},
                  live={"mlp": "v2", "cnn": "v7"})
    assert label_changes(pod) == {"inferd.io/mlp-version": "v2", "inferd.io/cnn-version": "v7",
                                  "inferd.io/old-version": None}
    settled = PodView("p", "n", labels={"inferd.io/mlp-version": "v2"}, live={"mlp": "v2"})
    assert label_changes(settled) == {}


def test_a_pod_whose_metrics_were_not_read_keeps_its_labels():
    assert label_changes(PodView("p", "n", labels={"inferd.io/mlp-version": "v1"}, scraped=False)) == {}


def test_names_and_versions_that_cannot_be_labels_are_left_out():
    assert version_label("mlp") == "inferd.io/mlp-version"
    assert version_label("_private") is None
    assert version_label("m" * 60) is None
    pod = PodView("p", "n", live={"mlp": "v1+local", "_x": "v1", "cnn": "v2"})
    assert label_changes(pod) == {"inferd.io/cnn-version": "v2"}


# -- fragmentation -------------------------------------------------------------------------


def pod(name: str, node: str, reserved_gib: float, unused_gib: float, **kw) -> PodView:
    return PodView(name, node, reserved_bytes=int(reserved_gib * GIB), unused_bytes=int(unused_gib * GIB), **kw)


def test_node_fragmentation_weighs_each_pod_by_what_it_reserves():
    found = node_fragmentation([pod("a", "n1", 30, 3), pod("b", "n1", 10, 7), pod("c", "n2", 0, 0)])
    assert found == {"n1": pytest.approx(10 / 40), "n2": 0.0}


POLICY = Policy(threshold=0.25, hold_s=300, trim_grace_s=120)


def test_a_node_is_labelled_and_trimmed_only_once_it_held_over_the_threshold():
    watch = FragmentationWatch(POLICY)
    pods = [pod("a", "n1", 10, 5), pod("b", "n1", 10, 1), pod("c", "n2", 10, 1)]
    assert watch.step(0, pods, set()) == []
    assert watch.step(299, pods, set()) == []
    assert watch.step(300, pods, set()) == [LabelNode("n1", True, 0.3), Trim("n1", ("a", "b"), 0.3)]
    watch.trimmed("n1", 300)
    # Labelled now, and the trim reached the pods: nothing more until the grace has passed.
    assert watch.step(400, pods, {"n1"}) == []
    assert watch.step(420, pods, {"n1"}) == [Evict("n1", "a", 0.3)]


def test_a_trim_that_reached_no_pod_is_asked_again_and_starts_no_grace():
    watch = FragmentationWatch(POLICY)
    pods = [pod("a", "n1", 10, 5)]
    watch.step(0, pods, set())
    assert watch.step(300, pods, {"n1"}) == [Trim("n1", ("a",), 0.5)]
    assert watch.step(500, pods, {"n1"}) == [Trim("n1", ("a",), 0.5)]  # not delivered: no eviction yet
    watch.trimmed("n1", 500)
    assert watch.step(600, pods, {"n1"}) == []
    assert watch.step(620, pods, {"n1"}) == [Evict("n1", "a", 0.5)]


def test_a_dip_under_the_threshold_starts_the_hold_again_and_clears_the_label():
    watch = FragmentationWatch(POLICY)
    over, under = [pod("a", "n1", 10, 5)], [pod("a", "n1", 10, 1)]
    watch.step(0, over, set())
    assert watch.step(200, under, set()) == []
    assert watch.step(400, over, set()) == []  # 200 s over again, not 400
    assert watch.step(700, over, set())[0] == LabelNode("n1", True, 0.5)
    assert watch.step(800, under, {"n1"}) == [LabelNode("n1", False, 0.1)]


def test_a_node_whose_pods_were_not_read_keeps_its_hold_and_its_label():
    watch = FragmentationWatch(POLICY)
    over = [pod("a", "n1", 10, 5)]
    watch.step(0, over, set())
    assert watch.step(200, [PodView("a", "n1", scraped=False)], {"n1"}) == []
    assert watch.step(300, over, {"n1"}) == [Trim("n1", ("a",), 0.5)]  # still held since 0


def test_a_labelled_node_without_inference_pods_is_cleared():
    assert FragmentationWatch(POLICY).step(0, [pod("a", "n1", 10, 0)], {"gone"}) == [LabelNode("gone", False, 0.0)]


def test_a_node_stranding_little_memory_is_not_fragmented_whatever_its_share():
    watch = FragmentationWatch(POLICY)
    small = [pod("a", "n1", 1, 0.5)]  # 50 %, but 0.5 GiB: a restart's cold start costs more
    assert watch.step(0, small, set()) == [] and watch.step(1000, small, set()) == []


def test_a_trim_that_worked_means_no_eviction():
    watch = FragmentationWatch(POLICY)
    watch.step(0, [pod("a", "n1", 10, 5)], set())
    assert isinstance(watch.step(300, [pod("a", "n1", 10, 5)], set())[-1], Trim)
    watch.trimmed("n1", 300)
    assert watch.step(500, [pod("a", "n1", 6, 1)], {"n1"}) == [LabelNode("n1", False, pytest.approx(1 / 6))]


def held_and_trimmed(watch: FragmentationWatch, pods: list[PodView]) -> None:
    watch.step(0, pods, set())
    for action in watch.step(300, pods, set()):
        if isinstance(action, Trim):
            watch.trimmed(action.node, 300)


def test_evictions_are_one_at_a_time_and_take_the_pod_stranding_most():
    watch = FragmentationWatch(POLICY)
    pods = [pod("a", "n1", 10, 3), pod("b", "n1", 10, 4), pod("c", "n2", 10, 9), pod("d", "n3", 10, 0)]
    held_and_trimmed(watch, pods)
    actions = watch.step(420, pods, {"n1", "n2"})
    assert actions == [Evict("n2", "c", 0.9)]  # n2 strands 9 GiB, n1 7 GiB: one eviction only
    watch.evicted("n2")
    # The evicted pod is on its way out: nothing else is evicted until it is gone and its replacement ready.
    going = [*pods[:2], PodView("c", "n2", scraped=False, moving=True), pods[3]]
    assert watch.step(450, going, {"n1", "n2"}) == []
    settled = [*pods[:2], pod("e", "n2", 10, 0), pods[3]]
    assert watch.step(480, settled, {"n1", "n2"}) == [LabelNode("n2", False, 0.0), Evict("n1", "b", 0.35)]


def test_a_refused_eviction_is_asked_again_and_an_evicted_node_starts_over():
    watch = FragmentationWatch(POLICY)
    pods = [pod("a", "n1", 10, 5), pod("b", "n1", 10, 5)]
    held_and_trimmed(watch, pods)
    assert watch.step(420, pods, {"n1"}) == [Evict("n1", "b", 0.5)]
    assert watch.step(450, pods, {"n1"}) == [Evict("n1", "b", 0.5)]  # refused: not reported as evicted
    watch.evicted("n1")
    left = [pods[0]]
    assert watch.step(460, left, {"n1"}) == []
    assert watch.step(760, left, {"n1"}) == [Trim("n1", ("a",), 0.5)]


# -- what is read from a pod --------------------------------------------------------------


def test_pod_metrics_are_parsed_from_an_inferd_page():
    text = GPU_PAGE.format(v="v2", ratio1=0.5, ratio2=0.25)
    found = parse_metrics(text)
    assert found.live == {"mlp": "v2"}
    assert (found.reserved_bytes, found.unused_bytes) == (30 * GIB, int(0.5 * 10 * GIB + 0.25 * 20 * GIB))


def test_the_downward_api_annotations_file_is_parsed():
    text = 'inferd.io/trim-requested="2026-12-01T10:00:00Z"\nnote="say \\"hi\\"\\nthere"\nbroken=\n'
    assert parse_annotations(text) == {TRIM_ANNOTATION: "2026-12-01T10:00:00Z", "note": 'say "hi"\nthere'}


def test_a_trim_request_is_due_once_per_new_value(tmp_path):
    path = tmp_path / "annotations"
    path.write_text(f'{TRIM_ANNOTATION}="1"\n')
    requests = TrimRequests()
    requests.configure(str(path))
    assert requests.due() is None  # there before the daemon: it asked the process this one replaces
    path.write_text(f'{TRIM_ANNOTATION}="2"\nother="x"\n')
    assert requests.due() == "2"
    assert requests.due() is None
    path.write_text('other="y"\n')
    assert requests.due() is None
    path.write_text(f'{TRIM_ANNOTATION}="2"\n')
    assert requests.due() == "2"


# -- the controller, for real -------------------------------------------------------------

GPU_PAGE = """# HELP inferd_model_live 1 for the version each model serves.
# TYPE inferd_model_live gauge
inferd_model_live{{model="mlp",version="{v}"}} 1.0
# HELP inferd_gpu_memory_fragmentation_ratio Reserved but unallocated GPU memory over reserved memory.
# TYPE inferd_gpu_memory_fragmentation_ratio gauge
inferd_gpu_memory_fragmentation_ratio{{worker="0"}} {ratio1}
inferd_gpu_memory_fragmentation_ratio{{worker="1"}} {ratio2}
# HELP inferd_gpu_memory_reserved_bytes GPU memory the worker's allocator reserves.
# TYPE inferd_gpu_memory_reserved_bytes gauge
inferd_gpu_memory_reserved_bytes{{worker="0"}} 10737418240
inferd_gpu_memory_reserved_bytes{{worker="1"}} 21474836480
"""


class MetricsPage:
    """A stand-in for a GPU pod's /metrics: the page a GPU daemon writes, with figures the test sets."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        page = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                body = GPU_PAGE.format(v="v1", ratio1=page.ratio, ratio2=page.ratio).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Fleet:
    """The inferd-fleet program, run as a process against the fake API."""

    def __init__(self, api: str, folder: Path, *args: str) -> None:
        self.metrics = f"127.0.0.1:{free_port()}"
        self.log_path = folder / "fleet.log"
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from inferd.fleet.main import main; main()", "--kubeconfig",
             str(kubeconfig(folder, api)), "--metrics", self.metrics, *args],
            stderr=self.log_path.open("w"), stdout=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text()

    def samples(self, name: str) -> list:
        try:
            with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return []
        return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]

    def actions(self) -> dict[tuple[str, str], float]:
        return {(s.labels["action"], s.labels["outcome"]): s.value for s in self.samples("inferd_fleet_actions_total")}

    def ticks(self) -> float:
        return sum(s.value for s in self.samples("inferd_fleet_ticks_total"))

    def stop(self) -> None:
        self.process.terminate()
        assert self.process.wait(10) == 0, self.log()


@pytest.fixture
def fleet(tmp_path) -> Iterator:
    started: list[Fleet] = []

    def start(kube: FakeKube | str, *args: str) -> Fleet:
        started.append(Fleet(kube if isinstance(kube, str) else kube.url, tmp_path, *args))
        return started[-1]

    yield start
    for process in started:
        if process.process.poll() is None:
            process.process.kill()
            process.process.wait()


def rights() -> set[tuple[str, str, str, bool]]:
    """(verb, resource, subresource, namespaced) that the fleet's Role (namespaced) and ClusterRole grant."""
    found = set()
    for doc in (d for path in FLEET.glob("*.yaml") for d in yaml.safe_load_all(path.read_text()) if d):
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        for rule in doc["rules"]:
            assert rule["apiGroups"] == [""], "the controller calls only the core API"
            for resource in rule["resources"]:
                base, _, sub = resource.partition("/")
                found |= {(verb, base, sub, doc["kind"] == "Role") for verb in rule["verbs"]}
    return found


def test_version_labels_follow_a_reload_of_a_real_daemon(reload_daemon, workdir, fleet):
    metrics = f"127.0.0.1:{free_port()}"
    daemon = reload_daemon(server={"metrics": metrics})
    kube = FakeKube()
    kube.add_node("node-a")
    kube.add_pod("inferd-0", "node-a", metrics, labels={"inferd.io/mlp-version": "v0"})
    with kube.running():
        controller = fleet(kube, "--interval", "1s")
        wait_for(lambda: kube.labels("inferd-0").get("inferd.io/mlp-version") == "v1", 30, "the v1 label")
        daemon.call("reload", version="v2", timeout=60)
        wait_for(lambda: kube.labels("inferd-0").get("inferd.io/mlp-version") == "v2", 30, "the v2 label")
        assert kube.labels("inferd-0")["app.kubernetes.io/name"] == "inferd"  # a merge patch, not a replace
        wait_for(lambda: "labelled pod inferd-0: inferd.io/mlp-version=v2" in controller.log(), 10, "the log line")
        wait_for(lambda: controller.actions().get(("label_pod", "done")) == 2, 10, "two counted labellings")
        controller.stop()
    assert set(kube.requests) <= rights()


def test_a_pod_turning_ready_is_labelled_from_the_watch_and_after_the_watch_expires(reload_daemon, fleet):
    metrics = f"127.0.0.1:{free_port()}"
    reload_daemon(server={"metrics": metrics})
    kube = FakeKube()
    kube.add_pod("inferd-0", "node-a", metrics)
    kube.add_pod("inferd-dead", "node-a", metrics, phase="Failed", ready=False)

    def lists() -> int:
        return kube.requests.count(("list", "pods", "", True))

    with kube.running():
        # An hour between ticks: only the watch can see the pods that come later.
        controller = fleet(kube, "--interval", "1h")
        wait_for(lambda: kube.labels("inferd-0").get("inferd.io/mlp-version") == "v1", 30, "the first label")
        kube.add_pod("inferd-1", "node-b", None, ready=False)
        kube.add_pod("inferd-2", "node-b", metrics, ready=False)
        kube.set_ready("inferd-2", True)
        wait_for(lambda: kube.labels("inferd-2").get("inferd.io/mlp-version") == "v1", 30, "the watched pod's label")
        assert lists() == 1, "labelled from a new list, not from the watch"
        kube.expire_watches()
        wait_for(lambda: lists() == 2 and "listing again" in controller.log(), 30, "the list after the expiry")
        kube.add_pod("inferd-3", "node-b", metrics, ready=False)
        kube.set_ready("inferd-3", True)
        wait_for(lambda: kube.labels("inferd-3").get("inferd.io/mlp-version") == "v1", 30, "the next watch's label")
        assert lists() == 2
        assert "inferd.io/mlp-version" not in kube.labels("inferd-1")  # not ready, no metrics: left alone
        assert "inferd.io/mlp-version" not in kube.labels("inferd-dead")  # ended: not the controller's
        controller.stop()


def test_a_fragmented_node_is_trimmed_then_its_pods_evicted_one_at_a_time_within_the_budget(fleet):
    kube = FakeKube()
    pages = {name: MetricsPage(ratio) for name, ratio in [("a", 0.5), ("b", 0.4), ("c", 0.05), ("new", 0.0)]}
    for name, node in [("a", "node-1"), ("b", "node-1"), ("c", "node-2")]:
        kube.add_node(node)
        kube.add_pod(f"inferd-{name}", node, pages[name].address)
    kube.add_node("node-3")
    # A pod the kubelet evicted stays in the API, never ready: it must not hold the evictions back.
    kube.add_pod("inferd-dead", "node-2", None, ready=False, phase="Failed")
    # As the ReplicaSet would: each evicted pod is replaced by one that is not ready at first.
    kube.on_deleted = lambda name: kube.add_pod(f"{name}-new", "node-3", pages["new"].address, ready=False)
    kube.add_budget("inferd", {"app.kubernetes.io/name": "inferd"}, expected=3, minAvailable=3)
    try:
        with kube.running():
            controller = fleet(kube, "--interval", "0.5s", "--fragmentation-for", "1s", "--trim-grace", "1s")
            wait_for(lambda: kube.node_labels("node-1").get(FRAGMENTED_LABEL) == "true", 30, "the node label")
            wait_for(lambda: {TRIM_ANNOTATION} <= set(kube.annotations("inferd-a"))
                     and {TRIM_ANNOTATION} <= set(kube.annotations("inferd-b")), 30, "the trim requests")
            assert TRIM_ANNOTATION not in kube.annotations("inferd-c")
            assert FRAGMENTED_LABEL not in kube.node_labels("node-2")
            # minAvailable 3 of 3: the budget refuses, and the controller asks again later.
            wait_for(lambda: kube.refused.count("inferd-a") >= 2, 30, "two refused evictions")
            assert kube.evictions == [] and "inferd-a" in kube.pods
            kube.add_budget("inferd", {"app.kubernetes.io/name": "inferd"}, expected=3, maxUnavailable=1)
            wait_for(lambda: kube.evictions == ["inferd-a"], 30, "the first eviction, of the pod stranding most")
            # node-1 (b: 40 %) starts over: held, trimmed again, its grace passes; but a's replacement is not
            # ready, so nothing more is evicted, however many ticks go by.
            wait_for(lambda: controller.actions().get(("trim", "done")) == 3, 30, "b's second trim")
            ticks = controller.ticks()
            wait_for(lambda: controller.ticks() >= ticks + 3, 30, "three ticks past b's second trim")
            assert kube.evictions == ["inferd-a"]
            kube.set_ready("inferd-a-new", True)
            wait_for(lambda: kube.evictions == ["inferd-a", "inferd-b"], 30, "the second eviction")
            wait_for(lambda: FRAGMENTED_LABEL not in kube.node_labels("node-1"), 30, "the node label's removal")
            for line in ("node node-1 is fragmented (45% of reserved GPU memory unused)",
                         "asked pod inferd-a to trim", "asked pod inferd-b to trim",
                         "eviction of pod inferd-a refused", "disruption budget",
                         "evicted pod inferd-a to restart clean", "evicted pod inferd-b to restart clean",
                         "node node-1 is no longer fragmented"):
                wait_for(lambda line=line: line in controller.log(), 10, f"the log line {line!r}")
            wait_for(lambda: controller.actions().get(("unlabel_node", "done")) == 1, 10, "the counted unlabel")
            actions = controller.actions()
            assert actions[("trim", "done")] == 3 and actions[("evict", "done")] == 2
            assert actions[("evict", "refused")] >= 2 and actions[("label_node", "done")] == 1
            controller.stop()
    finally:
        for page in pages.values():
            page.close()
    # Every right the controller holds is one it used here, in its scope, and it used no other.
    assert set(kube.requests) == rights()


def test_the_controller_rides_out_an_api_outage(fleet):
    controller = fleet(f"http://127.0.0.1:{free_port()}", "--interval", "1s")  # nothing listens there
    wait_for(lambda: "a Kubernetes API call failed" in controller.log(), 30, "the outage's log line")
    assert controller.process.poll() is None


def test_a_bad_kubeconfig_is_one_sentence(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("{not yaml")
    done = subprocess.run([sys.executable, "-c", "from inferd.fleet.main import main; main()", "--kubeconfig",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("inferd-fleet: cannot reach the Kubernetes API") and "Traceback" not in done.stderr


# -- a trim request reaching a real daemon ------------------------------------------------


def kubelet_writes(volume: Path, annotations: str) -> None:
    """Write a downward-API volume as the kubelet's atomic writer does: the files in a fresh timestamped
    folder, then the ..data link swung over to it by a rename; `annotations` is a link through ..data."""
    fresh = volume / f"..{time.monotonic_ns()}"
    fresh.mkdir()
    (fresh / "annotations").write_text(annotations)
    (volume / "..data_tmp").symlink_to(fresh.name)
    (volume / "..data_tmp").replace(volume / "..data")
    if not (volume / "annotations").is_symlink():
        (volume / "annotations").symlink_to("..data/annotations")


def test_the_annotation_and_inferctl_trim_reach_every_worker(workdir, reload_repo):
    volume = workdir / "podinfo"
    volume.mkdir()
    kubelet_writes(volume, f'{TRIM_ANNOTATION}="before"\n')
    annotations = volume / "annotations"
    config = base_config(workdir, reload_repo, {"mlp": RELOAD_MLP},
                         workers={"devices": ["cpu", "cpu"], "trim_request_file": str(annotations)})
    daemon = Daemon(workdir, config).start()
    try:
        asked = "asked to trim: nothing to return on the CPU"
        done = subprocess.run([str(Path(sys.executable).parent / "inferctl"), "--control", daemon.control, "trim"],
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, "asked 2 workers to return their unused GPU memory\n")
        wait_for(lambda: daemon.log().count(asked) == 2, 30, "both workers' trims")
        kubelet_writes(volume, f'{TRIM_ANNOTATION}="2026-12-01T10:00:00Z"\n')
        wait_for(lambda: daemon.log().count(asked) == 4, 30, "the annotation's trims")
        assert f"trim asked by the pod annotation {TRIM_ANNOTATION}=2026-12-01T10:00:00Z" in daemon.log()
        assert daemon.log().count("trim asked by") == 2  # the value there at start asked nothing
    finally:
        daemon.kill_all()
