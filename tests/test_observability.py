"""inferctl stats, the Prometheus endpoint, the leak watch, slow batches and inferctl stacks."""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import models
import numpy as np
import pytest
from conftest import MLP, wait_for
from prometheus_client.parser import text_string_to_metric_families
from wire import RawPeer

from inferd.harness import free_port

BIN = Path(sys.executable).parent
TWO = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 8, "warmup_batch_sizes": [1]}
SIZES = [1, 2, 3, 4, 5]


def metrics_config() -> dict:
    return {"server": {"metrics": f"127.0.0.1:{free_port()}"}}


def scrape(daemon) -> dict:
    """The daemon's /metrics, parsed: {(name, sorted labels): value}."""
    url = f"http://{daemon.config['server']['metrics']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def send_known(daemon, count: int) -> int:
    """`count` requests, one at a time, of 1..5 samples in turn; return the samples sent."""
    sent = 0
    with RawPeer(daemon.endpoint) as peer:
        for i in range(count):
            x = np.ones((SIZES[i % len(SIZES)], models.MLP_IN), dtype=np.float32)
            peer.send(i, "mlp", [x])
            assert peer.recv()[0]["status"] == "ok"
            sent += x.shape[0]
    return sent


def test_stats_and_metrics_count_exactly_what_was_sent(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server=metrics_config()["server"])
    count = 37
    samples = send_known(daemon, count)
    with RawPeer(daemon.endpoint) as peer:  # and one that is refused
        peer.send(99, "mlp", [np.ones((1, 3), dtype=np.float32)])
        assert peer.recv()[0]["status"] == "invalid"

    stats = json.loads(subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, "stats", "--json"],
                                      capture_output=True, text=True, check=True).stdout)
    mlp = stats["models"]["mlp"]
    assert mlp["live_version"] == "v2"
    assert mlp["requests"] == {"ok": count, "invalid": 1}
    assert mlp["samples"] == samples
    distribution = {int(size): n for size, n in mlp["batch_size"]["distribution"].items()}
    assert sum(size * n for size, n in distribution.items()) == samples
    for part in ("total", "queue", "compute"):
        latency = mlp["latency_ms"][part]
        assert latency["max"] >= latency["p99"] >= latency["p90"] >= latency["p50"] >= 0
    assert mlp["latency_ms"]["total"]["p50"] > 0
    assert mlp["latency_ms"]["total"]["p99"] >= mlp["latency_ms"]["compute"]["p50"]
    assert mlp["throughput"]["samples_per_s_60s"] > 0
    assert mlp["versions"]["v2"]["requests"]["ok"] == count
    assert mlp["priorities"]["1"]["requests"] == {"ok": count}, "the invalid one never had a level"
    assert mlp["goodput"]["requests"] == count and mlp["goodput"]["requests_per_s_60s"] > 0
    assert mlp["admission"]["estimate_ms"] > 0 and mlp["admission"]["refused_as_late"] == 0
    worker = stats["workers"][0]
    assert worker["batches"] == count and worker["rss_bytes"] > 10 * 2**20 and worker["leak_warning"] is False
    assert "gpu_memory_used_bytes" not in worker, "no NVML here: GPU fields are absent, not errors"

    table = subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, "stats"],
                           capture_output=True, text=True, check=True).stdout
    row = next(line for line in table.splitlines() if line.startswith("mlp"))
    assert row.split()[2] == str(count + 1) and row.split()[3] == "1", table
    level_row = [line for line in table.splitlines() if line.startswith("mlp")][1]
    assert level_row.split()[:4] == ["mlp", "1", str(count), "0"], table
    assert "admission: a new request to mlp would finish in" in table

    metrics = scrape(daemon)
    labels = (("model", "mlp"), ("status", "ok"), ("version", "v2"))
    assert metrics[("inferd_requests_total", labels)] == count
    assert metrics[("inferd_samples_total", (("model", "mlp"), ("version", "v2")))] == samples
    version = (("model", "mlp"), ("version", "v2"))
    assert metrics[("inferd_request_duration_seconds_count", version)] == count
    assert metrics[("inferd_batch_size_count", version)] == count
    assert metrics[("inferd_batch_size_sum", version)] == samples
    assert metrics[("inferd_model_live", (("model", "mlp"), ("version", "v2")))] == 1
    assert metrics[("inferd_queue_depth", (("model", "mlp"),))] == 0
    assert metrics[("inferd_worker_restarts_total", (("worker", "0"),))] == 0
    assert ("inferd_memory_growth_bytes", (("worker", "0"),)) in metrics


def test_stats_watch_refreshes_until_ctrl_c(start_daemon):
    daemon = start_daemon({"mlp": MLP})
    watch = subprocess.Popen([str(BIN / "inferctl"), "--control", daemon.control, "stats", "--watch", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watch.stdout is not None
    refreshes = 0
    while refreshes < 3:  # read until it has refreshed three times
        line = watch.stdout.readline()
        assert line, "the watch stopped by itself"
        refreshes += "inferd serving" in line
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=10)
    assert watch.returncode == 0, err


def test_the_leak_watch_warns_about_a_leaking_model_once(start_daemon):
    daemon = start_daemon({"leaky": TWO})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(3):
            peer.send(i, "leaky", [np.ones((1, 2), dtype=np.float32)])
            assert peer.recv()[0]["status"] == "ok"
    worker = daemon.call("stats")["workers"][0]
    assert worker["leak_warning"] is True
    assert worker["memory_growth_bytes"] >= 250 * 2**20
    assert daemon.log().count("memory grew") == 1


def test_the_leak_watch_stays_quiet_for_a_model_that_does_not_leak(start_daemon):
    daemon = start_daemon({"mlp": MLP}, server=metrics_config()["server"])
    send_known(daemon, 300)
    worker = daemon.call("stats")["workers"][0]
    assert worker["leak_warning"] is False and worker["memory_growth_bytes"] < 50 * 2**20
    assert "memory grew" not in daemon.log()
    assert scrape(daemon)[("inferd_memory_growth_bytes", (("worker", "0"),))] < 50 * 2**20


def test_a_batch_far_slower_than_the_median_is_logged_unless_it_is_still_quick(start_daemon):
    # A fraction of a millisecond a normal batch; then one of ~10 ms (far over 5x the median, but too quick
    # to be worth a line), then one of ~1 s. Warnings come at most one per 10 s, so had the quick one been
    # logged, the slow one's would be missing.
    daemon = start_daemon({"variable": TWO})
    with RawPeer(daemon.endpoint) as peer:
        for i in range(60):
            peer.send(i, "variable", [np.full((1, 2), 20, dtype=np.float32)])
            assert peer.recv()[0]["status"] == "ok"
        for i, steps in enumerate((2_000, 200_000)):
            peer.send(100 + i, "variable", [np.full((1, 2), steps, dtype=np.float32)])
            assert peer.recv()[0]["status"] == "ok"
    # The warning is logged once the batch's replies are on their way, so it may follow the reply.
    warning = wait_for(lambda: [line for line in daemon.log().splitlines() if "over 5x the median" in line],
                       what="the slow batch's warning")
    took_ms = float(re.search(r"took ([0-9.]+) ms", warning[0]).group(1))
    assert "batch" in warning[0] and took_ms > 200, warning


def test_stacks_shows_where_every_process_is(start_daemon):
    daemon = start_daemon({"mlp": MLP}, workers={"devices": ["cpu", "cpu"]})
    result = subprocess.run([str(BIN / "inferctl"), "--control", daemon.control, "stacks"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "== supervisor ==" in out and "_loop" in out
    for index in (0, 1):
        section = out.split(f"== worker{index} ")[1].split("== ")[0]
        assert "executor.py" in section and "Thread 0x" in section, section


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus server is not installed")
def test_a_real_prometheus_scrapes_the_daemon(start_daemon, workdir):
    daemon = start_daemon({"mlp": MLP}, server=metrics_config()["server"])
    count = 23
    send_known(daemon, count)
    port = free_port()
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: inferd\n"
        f"    static_configs:\n      - targets: ['{daemon.config['server']['metrics']}']\n"
    )
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        query = urllib.parse.urlencode({"query": 'inferd_requests_total{model="mlp",status="ok"}'})
        deadline = time.monotonic() + 60
        value = None
        while time.monotonic() < deadline:
            try:
                answer = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5))
                results = answer["data"]["result"]
                if results:
                    value = float(results[0]["value"][1])
                    if value == count:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        assert value == count
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


def test_idle_connections_to_the_metrics_port_cannot_take_the_supervisors_descriptors(start_daemon):
    limit, idle = 256, 300  # more connections than the supervisor has descriptors
    server = metrics_config()["server"]
    daemon = start_daemon({"mlp": MLP}, open_files=(limit, limit), server=server)
    host, port = server["metrics"].rsplit(":", 1)
    held = [socket.create_connection((host, int(port))) for _ in range(idle)]
    try:
        poller = select.poll()
        for connection in held:
            poller.register(connection, select.POLLIN)
        closed: set[int] = set()

        def closed_by_the_daemon(least: int) -> bool:
            for fd, _ in poller.poll(0):
                poller.unregister(fd)
                closed.add(fd)
            return len(closed) >= least

        # All but a few are closed at once; the few served are closed when they have said nothing for 10 s.
        wait_for(lambda: closed_by_the_daemon(idle - 16), what="the connections past 16 closed")
        for _ in range(20):  # each a new connection to the ipc:// control socket, which libzmq cannot refuse
            assert daemon.call("health")["healthy"]
        wait_for(lambda: closed_by_the_daemon(idle), timeout=30, what="the idle connections closed")
    finally:
        for connection in held:
            connection.close()
    with socket.create_connection((host, int(port))) as trickle:  # a byte of its request each half second
        trickle.settimeout(0.5)

        def closed_while_trickling() -> bool:
            try:
                trickle.send(b"G")
                return trickle.recv(1) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        wait_for(closed_while_trickling, timeout=30, what="a trickling connection closed, 10 s after it came")
    assert ("inferd_model_live", (("model", "mlp"), ("version", "v2"))) in scrape(daemon)
    assert daemon.process.poll() is None
