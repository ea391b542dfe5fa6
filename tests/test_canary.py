"""Canary, shadow and their guard against the real daemon: splits, comparisons, rollbacks, restarts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import models
import numpy as np
import pytest
from conftest import RELOAD_MLP, Daemon, base_config, requests_accounted, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_reload import Traffic, expected, inferctl
from wire import RawPeer

from inferd.harness import free_port, to_toml
from inferd.ipc.control import ControlError


def versions_of(records) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, header, _, _ in records:
        counts[header.get("version")] = counts.get(header.get("version"), 0) + 1
    return counts


def send_each(daemon: Daemon, arrays: list[np.ndarray], after_each: Callable[[], object] | None = None,
              **header) -> list[tuple[dict, list[np.ndarray]]]:
    """One request after the other, each waiting for its reply (and then for `after_each`, if given)."""
    replies = []
    with RawPeer(daemon.endpoint) as peer:
        for i, x in enumerate(arrays):
            peer.send(i, "mlp", [x], **header)
            replies.append(peer.recv())
            if after_each is not None:
                after_each()
    return replies


def rows(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, models.MLP_IN), dtype=np.float32) for _ in range(count)]


def test_a_canary_takes_its_weight_and_requests_that_name_a_version_keep_it(reload_daemon, references):
    daemon = reload_daemon(workers={"devices": ["cpu", "cpu"]})
    result = inferctl(daemon, "reload", "--version", "v2", "--canary", "20")
    assert result.returncode == 0, result.stderr
    assert "mlp v2 is a canary at 20 % beside v1" in result.stdout
    status = daemon.status()["models"]["mlp"]
    assert status["live_version"] == "v1" and status["candidate"]["version"] == "v2"
    assert status["candidate"]["mode"] == "canary" and status["candidate"]["weight"] == 20
    assert "canary v2 at 20 %" in inferctl(daemon, "status").stdout
    with Traffic(daemon, threads=4) as traffic:
        traffic.wait_for_more(1500)
    traffic.check(references)  # every reply ok and equal to the model it names, in this process
    counts = versions_of(traffic.records)
    assert set(counts) == {"v1", "v2"}
    share = counts["v2"] / len(traffic.records)
    assert 0.15 <= share <= 0.25, counts
    routed = daemon.call("stats")["models"]["mlp"]["candidate"]["routed_share"]
    assert abs(routed - 0.2) < 0.02, routed

    for named in ("v1", "v2"):
        replies = send_each(daemon, rows(30, seed=1), version=named)
        assert {h["status"] for h, _ in replies} == {"ok"} and {h["version"] for h, _ in replies} == {named}
    header, _ = send_each(daemon, rows(1), version="v3")[0]
    assert header["status"] == "invalid"
    assert "version 'v3' of mlp is not live; the live version is 'v1' (and 'v2' is its canary)" in header["error"]

    result = inferctl(daemon, "canary", "--weight", "100")
    assert result.returncode == 0 and "mlp canary v2 now at 100 % (was 20 %)" in result.stdout, result.stderr
    assert {h["version"] for h, _ in send_each(daemon, rows(40, seed=2))} == {"v2"}
    result = inferctl(daemon, "canary", "--weight", "0")
    assert result.returncode == 0, result.stderr
    assert {h["version"] for h, _ in send_each(daemon, rows(40, seed=3))} == {"v1"}


def test_a_refused_request_that_named_a_version_counts_against_that_version(reload_daemon):
    daemon = reload_daemon()
    wrong = [np.zeros((1, models.MLP_IN + 1), dtype=np.float32)] * 5  # a shape mlp does not take: invalid
    assert daemon.call("reload", timeout=60, version="v2", canary=20)["mode"] == "canary"
    assert {h["status"] for h, _ in send_each(daemon, rows(2), version="v2")} == {"ok"}
    refused = send_each(daemon, wrong[:3], version="v2") + send_each(daemon, wrong[:2], version="v1")
    assert result_of(inferctl(daemon, "promote")).startswith("mlp v2 is live (was v1)")
    # v1 is no longer live: the frontend refuses a request that names it; v9 never was, and makes no row.
    refused += send_each(daemon, rows(4), version="v1") + send_each(daemon, rows(1), version="v9")
    assert {h["status"] for h, _ in refused} == {"invalid"}
    versions = daemon.call("stats")["models"]["mlp"]["versions"]
    assert set(versions) == {"v1", "v2"}
    assert versions["v1"]["requests"] == {"invalid": 2 + 4}
    assert versions["v2"]["requests"] == {"ok": 2, "invalid": 3 + 1}
    table = inferctl(daemon, "stats").stdout
    assert "not ok, by kind (since start):\nmlp v1: 6 invalid\nmlp v2: 4 invalid\n" in table, table
    counted = {line.split()[0]: line.split()[1:3] for line in table.splitlines() if line.startswith("  ")}
    assert counted == {"v1": ["6", "6"], "v2*": ["6", "4"]}, table  # requests, not ok


def result_of(done) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_trial_commands_refuse_what_does_not_fit_in_one_sentence(reload_daemon):
    daemon = reload_daemon()
    for argv, sentence in [  # refused by inferctl itself
        (("reload", "--version", "v2", "--canary", "120"), "120.0 is not in the range 0<=x<=100"),
        (("reload", "--version", "v2", "--canary", "5", "--promote-after", "soon"), "'soon' is not a duration"),
        (("promote",), "mlp has no canary or shadow to promote"),
    ]:
        result = inferctl(daemon, *argv)
        assert result.returncode != 0 and sentence in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr
    for command, args, sentence in [  # refused by the daemon, each in one sentence
        ("canary", {"weight": 10}, "mlp has no canary or shadow; start one with inferctl reload"),
        ("reload", {"version": "v2", "canary": 5, "shadow": 5}, "as a canary or as a shadow, not both"),
        ("reload", {"version": "v2", "shadow": 5, "auto_rollback": True}, "a shadow serves no client"),
        ("reload", {"version": "v2", "auto_rollback": True}, "--auto-rollback and --promote-after go with --canary"),
        ("reload", {"version": "v2", "canary": 5, "promote_after_s": -1}, "a duration above zero, not -1 s"),
        ("reload", {"version": "corrupt", "canary": 5}, "corrupt was not made live"),
    ]:
        with pytest.raises(ControlError, match=re.escape(sentence)):
            daemon.call(command, timeout=60, **args)
    assert daemon.call("reload", timeout=60, version="v2", canary=5)["mode"] == "canary"
    result = inferctl(daemon, "reload", "--version", "v3")
    assert result.returncode == 1 and "mlp has a canary v2 at 5 %; promote it or roll it back first" in result.stderr
    assert daemon.status()["models"]["mlp"]["live_version"] == "v1"


def test_a_shadow_compares_outputs_and_clients_get_only_the_live_replies(workdir, reload_repo, references):
    metrics = f"127.0.0.1:{free_port()}"
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP}, server={"metrics": metrics}))
    try:
        daemon.start()
        for version, same in (("v1_twin", True), ("v2", False)):
            result = inferctl(daemon, "reload", "--version", version, "--shadow", "50")
            assert result.returncode == 0 and f"mlp {version} is a shadow at 50 % beside v1" in result.stdout

            def settled(v: str = version) -> dict | None:
                s = daemon.call("stats")["models"]["mlp"]["shadow"].get(v, {"chosen": 0, "compared": 0, "failed": 0,
                                                                              "dropped": {}})
                return s if s["compared"] + s["failed"] + sum(s["dropped"].values()) == s["chosen"] else None

            # Each request waits for the shadow work before it: executors are idle between requests, so no
            # shadow job finds the queue full (on a loaded machine an unpaced client outruns the candidate).
            arrays = rows(100, seed=4)
            replies = send_each(daemon, arrays, after_each=lambda: wait_for(settled, what="the shadow job settled"))
            for (header, outputs), x in zip(replies, arrays):
                assert header["status"] == "ok" and header["version"] == "v1"
                np.testing.assert_allclose(outputs[0], expected(references, "v1", x), rtol=1e-5, atol=1e-6)
            shadow = settled()
            assert shadow is not None and 40 <= shadow["chosen"] <= 60, "about half the requests are shadowed"
            # A job is dropped only as stale: one whose candidate took over a second.
            assert set(shadow["dropped"]) <= {"stale"}, shadow["dropped"]
            assert shadow["compared"] >= 0.9 * shadow["chosen"], f"dropped {shadow['dropped']} of {shadow['chosen']}"
            assert shadow["compute_ms"]["shadow"]["p50"] > 0 and shadow["compute_ms"]["live"]["p50"] > 0
            if same:
                assert shadow["allclose_share"] == 1.0 and shadow["max_abs_difference"] < 1e-5, shadow
            else:
                assert shadow["allclose_share"] < 0.05 and shadow["max_abs_difference"] > 0.05, shadow
            result = inferctl(daemon, "rollback")
            assert result.returncode == 0 and f"the shadow {version} at 50 % of mlp ended" in result.stdout
        table = inferctl(daemon, "stats").stdout
        assert "mlp shadow v2:" in table and "allclose" in table
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        compared = {tuple(sorted(s.labels.items())): s.value for s in families["inferd_shadow_requests"].samples
                    if s.name.endswith("_total")}
        assert compared[(("model", "mlp"), ("outcome", "compared"), ("version", "v2"))] == shadow["compared"]
        ratio = {s.labels["version"]: s.value for s in families["inferd_shadow_allclose_ratio"].samples}
        assert ratio["v1_twin"] == 1.0 and ratio["v2"] < 0.05
        outcomes = {s.labels["outcome"]: s.value for s in families["inferd_trials_ended"].samples
                    if s.name.endswith("_total")}
        assert outcomes == {"rolled_back": 2}
        durations = {s.labels["version"] for s in families["inferd_request_duration_seconds"].samples}
        assert durations == {"v1"}, "every figure is split by version; no client reply came from a shadow"
    finally:
        daemon.kill_all()


def test_a_failing_canary_is_rolled_back_by_its_guard(reload_daemon):
    guard = {"window_s": 10, "min_requests": 10}
    daemon = reload_daemon(model={**RELOAD_MLP, "canary_guard": guard}, workers={"devices": ["cpu", "cpu"]})
    result = inferctl(daemon, "reload", "--version", "fails_some", "--canary", "10")
    assert result.returncode == 0 and ", guarded" in result.stdout, result.stdout + result.stderr
    with Traffic(daemon, threads=4) as traffic:
        wait_for(lambda: daemon.status()["models"]["mlp"]["candidate"] is None, what="the guard's rollback")
        rolled_back, ended = time.monotonic(), len(traffic.records)
        traffic.wait_for_more(300)
    assert not traffic.errors
    statuses = [h["status"] for _, h, _, _ in traffic.records]
    canary = [h for _, h, _, _ in traffic.records if h.get("version") == "fails_some"]
    failed = [h for h in canary if h["status"] == "internal"]
    assert failed and set(statuses) == {"ok", "internal"}
    assert len(canary) <= 0.15 * len(traffic.records[:ended]) + 16, "no more went to the canary than its weight"
    assert all("above 1" in h["error"] for h in failed)
    # Sent once the rollback was seen (one sent before it may still come back from the canary, late).
    after = [h for sent, h, _, _ in traffic.records if sent > rolled_back]
    assert after and all(h["status"] == "ok" and h["version"] == "v1" for h in after)
    lines = [line for line in daemon.log().splitlines() if "ended by its guard" in line]
    assert len(lines) == 1 and "its share of failed replies (internal or timeout)" in lines[0], lines
    wait_for(lambda: all(w["loaded"] == ["mlp v1"] for w in daemon.status()["workers"]), what="the canary freed")
    assert daemon.call("stats")["models"]["mlp"]["versions"]["fails_some"]["requests"]["internal"] == len(failed)


def test_promote_and_rollback_under_load_drop_nothing(reload_daemon, references):
    daemon = reload_daemon(workers={"devices": ["cpu", "cpu"]})
    with Traffic(daemon) as traffic:
        assert daemon.call("reload", timeout=60, version="v2", canary=30)["mode"] == "canary"
        traffic.wait_for_more(200)
        assert daemon.call("canary", weight=70)["was"] == 30
        traffic.wait_for_more(200)
        result = inferctl(daemon, "promote")
        assert result.returncode == 0, result.stderr
        assert "mlp v2 is live (was v1), promoted from its canary v2 at 70 %" in result.stdout
        promoted = time.monotonic()
        traffic.wait_for_more(200)
        # Records are kept in the order of their replies: these were all answered before the next trial began
        # (one sent just before it may wait in the queue until the candidate is there, and go to it).
        answered_before_trial = len(traffic.records)
        assert daemon.call("reload", timeout=60, version="v3", canary=50)["live"] == "v2"
        traffic.wait_for_more(200)
        result = inferctl(daemon, "rollback")
        assert result.returncode == 0 and "the canary v3 at 50 % of mlp ended; v2 serves everything" in result.stdout
        rolled_back = time.monotonic()
        traffic.wait_for_more(200)
    traffic.check(references)  # nothing dropped: every reply ok, each from the version it names
    assert requests_accounted(daemon) == len(traffic.records), "every request the daemon read was answered"
    # A batch sent before a switch returned may answer from the version before it; none sent after.
    promoted_only = {h["version"] for sent, h, _, _ in traffic.records[:answered_before_trial] if sent > promoted}
    after_rollback = {h["version"] for sent, h, _, _ in traffic.records if sent > rolled_back}
    assert promoted_only == {"v2"} and after_rollback == {"v2"}
    assert versions_of(traffic.records).keys() == {"v1", "v2", "v3"}
    wait_for(lambda: all(w["loaded"] == ["mlp v2"] for w in daemon.status()["workers"]), what="v1 and v3 freed")


def test_a_sighup_version_change_refused_during_a_canary_is_tried_again_by_the_next_sighup(reload_daemon):
    daemon = reload_daemon()
    assert inferctl(daemon, "reload", "--version", "v2", "--canary", "25").returncode == 0
    config = daemon.config
    config["models"]["mlp"]["version"] = "v3"
    daemon.config_path.write_text(to_toml(config))
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: "models.mlp.version stays 'v1'" in daemon.log(), what="the change refused during the canary")
    assert daemon.status()["models"]["mlp"]["config_version"] == "v1", "what runs is not said to be v3"
    assert inferctl(daemon, "rollback").returncode == 0
    daemon.signal(signal.SIGHUP)  # the same file: its change is tried again
    wait_for(lambda: daemon.status()["models"]["mlp"]["live_version"] == "v3", what="v3 live")
    assert daemon.status()["models"]["mlp"]["config_version"] == "v3"


def test_a_restart_keeps_the_canary(reload_daemon):
    daemon = reload_daemon()
    result = inferctl(daemon, "reload", "--version", "v2", "--canary", "25", "--promote-after", "1h")
    assert result.returncode == 0 and "promoted after 3600 s if it stays clean" in result.stdout, result.stderr
    assert daemon.stop() == 0
    daemon.start()
    candidate = daemon.status()["models"]["mlp"]["candidate"]
    assert candidate["version"] == "v2" and candidate["weight"] == 25 and candidate["guarded"]
    assert 3000 < candidate["promote_in_s"] <= 3600
    wait_for(lambda: daemon.status()["workers"][0]["loaded"] == ["mlp v1", "mlp v2"], what="v2 loaded again")
    counts: dict[str, int] = {}
    for header, _ in send_each(daemon, rows(200, seed=5)):
        counts[header["version"]] = counts.get(header["version"], 0) + 1
    assert 30 <= counts.get("v2", 0) <= 70, counts
    assert "resuming the canary v2 at 25 %" in daemon.log()


def test_a_crashed_worker_comes_back_with_the_live_version_and_the_canary(reload_daemon):
    daemon = reload_daemon()
    assert daemon.call("reload", timeout=60, version="v2", canary=50)["mode"] == "canary"
    os.kill(daemon.status()["workers"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["workers"][0])["restarts"] == 1 and w["state"] == "ready"
             and w["loaded"] == ["mlp v1", "mlp v2"], timeout=60, what="the replacement with both versions")
    replies = [header for header, _ in send_each(daemon, rows(40, seed=8))]
    assert {h["status"] for h in replies} == {"ok"}, replies[:2]
    assert versions_of([(0, h, 0, 0) for h in replies]) == {"v1": 20, "v2": 20}
    assert daemon.status()["models"]["mlp"]["candidate"]["version"] == "v2"


@pytest.fixture
def variable_repo(workdir: Path, repo: Path) -> Path:
    """`variable` (the first value of a batch says how long it computes) as v1 and v2."""
    root = workdir / "repo"
    for version in ("v1", "v2"):
        (root / "variable" / version).mkdir(parents=True)
        shutil.copy(repo / "variable" / "v1" / "model.pt", root / "variable" / version / "model.pt")
    return root


def test_shadow_work_under_overload_is_dropped_and_never_runs_ahead_of_live_requests(workdir, variable_repo):
    model = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 1, "warmup_batch_sizes": [1],
             "version": "v1"}
    daemon = Daemon(workdir, base_config(workdir, variable_repo, {"variable": model}, workers={"streams": 1}))
    try:
        daemon.start()
        assert daemon.call("reload", timeout=60, version="v2", shadow=100)["mode"] == "shadow"
        count = 40
        x = np.array([[20_000.0, 0.0]], dtype=np.float32)  # some milliseconds each
        replies: list[dict] = []
        with RawPeer(daemon.endpoint) as peer:
            for i in range(count):  # all at once: the queue holds work until the last is computed
                peer.send(i, "variable", [x], timeout_ms=60_000)
            for _ in range(count):
                replies.append(peer.recv(timeout=60)[0])
        assert [h["status"] for h in replies] == ["ok"] * count
        assert {h["version"] for h in replies} == {"v1"}

        def settled():
            shadow = daemon.call("stats")["models"]["variable"]["shadow"].get("v2")
            done = shadow and shadow["compared"] + shadow["failed"] + sum(shadow["dropped"].values())
            return shadow if shadow and done == shadow["chosen"] == count else None

        shadow = wait_for(settled, what="every shadow job settled")
        assert shadow["dropped"].get("queue full", 0) >= count - 8, shadow
        assert shadow["compared"] <= 8, "shadow work ran only once the queue was empty"
    finally:
        daemon.kill_all()


def test_systemd_status_names_the_trial(workdir, reload_repo):
    from test_notify import FakeSystemd

    systemd = FakeSystemd(workdir / "notify.sock", abstract=False)
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP}))
    daemon.env = {"NOTIFY_SOCKET": systemd.address}
    try:
        daemon.start()
        daemon.call("reload", timeout=60, version="v2", canary=10)

        def announced() -> bool:
            return any("STATUS=" in m and "mlp v1 (canary v2 at 10 %)" in m for m in systemd.drain())

        wait_for(announced, what="a STATUS= naming the canary")
    finally:
        daemon.kill_all()
        systemd.close()


def test_the_guard_promotes_a_clean_canary_after_its_time(reload_daemon):
    # v2 computes as fast as v1, but beside a busy machine's noise one p99 can be 50 % and 5 ms over the other's:
    # this test is of the promotion, so only failures would make the window unclean.
    guard = {"window_s": 10, "min_requests": 10, "max_p99_increase": 100, "min_p99_increase_ms": 10_000}
    daemon = reload_daemon(model={**RELOAD_MLP, "canary_guard": guard})
    result = inferctl(daemon, "reload", "--version", "v2", "--canary", "50", "--promote-after", "2s")
    assert result.returncode == 0, result.stderr
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            send_each(daemon, rows(10, seed=6))

    sender = threading.Thread(target=load)
    sender.start()
    try:
        wait_for(lambda: daemon.status()["models"]["mlp"]["live_version"] == "v2"
                 or "ended by its guard" in daemon.log(), what="the promotion")
    finally:
        stop.set()
        sender.join()
    assert "ended by its guard" not in daemon.log(), daemon.log()
    assert "promoted by --promote-after: its window stayed clean" in daemon.log()
    # The switch is timed from the promotion, and says so (not as if the canary had begun a moment before).
    assert re.search(r"mlp is now v2 \(was v1\), [0-9.]+ s after the promotion of its canary began", daemon.log())
    assert daemon.status()["models"]["mlp"]["candidate"] is None


def test_over_the_open_inference_protocol_both_versions_may_be_named_during_a_canary(workdir, reload_repo,
                                                                                      references):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = f"127.0.0.1:{free_port()}"
    daemon = Daemon(workdir, base_config(workdir, reload_repo, {"mlp": RELOAD_MLP}, server={"http": http}))
    try:
        daemon.start()
        daemon.call("reload", timeout=60, version="v2", canary=0)
        client = httpclient.InferenceServerClient(http)
        x = rows(1, seed=7)[0]

        def infer(version: str = "") -> httpclient.InferResult:
            given = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            return client.infer("mlp", [given], model_version=version)

        def named_canary_served() -> httpclient.InferResult | None:
            try:
                return infer("v2")
            except InferenceServerException:  # the gateway reads the models' state once a second
                return None

        result = wait_for(named_canary_served, what="the gateway taking the canary's version")
        assert result.get_response()["model_version"] == "v2"
        np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), expected(references, "v2", x), rtol=1e-5, atol=1e-6)
        for version in ("v1", ""):
            assert infer(version).get_response()["model_version"] == "v1", "weight 0: nothing else goes to v2"
        assert client.get_model_metadata("mlp")["versions"] == ["v1", "v2"]
        with pytest.raises(InferenceServerException,
                           match="Request for unknown model: 'mlp' version 'v3' is not found"):
            infer("v3")
        client.close()
    finally:
        daemon.kill_all()
