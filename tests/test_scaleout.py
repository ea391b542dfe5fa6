"""Many daemons as one fleet: a client spread over three real daemons on loopback, and the rollout script."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MLP, RELOAD_MLP, Daemon, base_config, gated_reload_repo, wait_for
from wire import error, ok

from inferd import Client, RetryPolicy, Timeout
from inferd.client.endpoints import resolve
from inferd.harness import free_port

X = np.arange(6, dtype=np.float32).reshape(2, 3)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class Fleet:
    """Daemons started in folders of their own under one work folder; all killed at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.daemons: list[Daemon] = []

    def start(self, repo: Path, model: dict, wait: bool = True, **sections: dict) -> Daemon:
        folder = self.workdir / f"node{len(self.daemons)}"
        folder.mkdir()
        daemon = Daemon(folder, base_config(folder, repo, {"mlp": model}, **sections))
        self.daemons.append(daemon)
        return daemon.start(wait=wait)

    @staticmethod
    def serving(daemons: list[Daemon]) -> list[Daemon]:
        """Daemons started with wait=False, once every one is healthy (their start-ups overlap)."""
        for daemon in daemons:
            daemon.wait_healthy()
        return daemons

    def restart(self, daemon: Daemon) -> Daemon:
        """A new daemon with the same config as `daemon`, which is dead, on the port it had (its clients
        know that one)."""
        assert daemon.config is not None
        server = {**daemon.config["server"], "listen": [daemon.endpoint]}
        again = Daemon(daemon.workdir, {**daemon.config, "server": server})
        self.daemons.append(again)
        return again.start()

    def kill_all(self) -> None:
        for daemon in self.daemons:
            daemon.kill_all()


@pytest.fixture
def fleet(workdir: Path) -> Iterator[Fleet]:
    started = Fleet(workdir)
    yield started
    started.kill_all()


def answered_ok(daemon: Daemon) -> int:
    return daemon.status()["replies"].get("ok", 0)


def mlp_reference(repo: Path, daemon: Daemon):
    """The model `daemon` serves as mlp, loaded in this process."""
    version = daemon.status()["models"]["mlp"]["live_version"]
    module = torch.jit.load(str(repo / "mlp" / version / "model.pt"))

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()

    return run


def drive(client: Client, seconds: float, concurrency: int, stop: threading.Event | None = None
          ) -> list[tuple[np.ndarray, Future]]:
    """Keep `concurrency` requests in flight for `seconds` (or until `stop`); every request and its future."""
    rng = np.random.default_rng(0)
    sent: list[tuple[np.ndarray, Future]] = []
    in_flight: list[Future] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop and stop.is_set()):
        in_flight = [f for f in in_flight if not f.done()]
        while len(in_flight) < concurrency:
            x = rng.standard_normal((1, 16)).astype(np.float32)
            future = client.submit("mlp", x)
            sent.append((x, future))
            in_flight.append(future)
        time.sleep(0.002)
    return sent


def test_a_client_of_three_daemons_gives_each_a_fair_share(fleet, repo):
    daemons = fleet.serving([fleet.start(repo, MLP, wait=False) for _ in range(3)])
    reference = mlp_reference(repo, daemons[0])
    with Client([d.endpoint for d in daemons], timeout=20) as client:
        sent = drive(client, seconds=4, concurrency=12)
        for x, future in sent:
            np.testing.assert_allclose(future.result(), reference(x), rtol=1e-5, atol=1e-6)
    shares = [answered_ok(d) for d in daemons]
    assert sum(shares) == len(sent)
    assert min(shares) > 0.2 * len(sent), f"uneven spread: {shares}"


def test_a_daemon_killed_mid_run_costs_nothing_and_is_used_again_once_back(fleet, repo):
    daemons = fleet.serving([fleet.start(repo, MLP, wait=False) for _ in range(3)])
    victim = daemons[1]
    reference = mlp_reference(repo, daemons[0])
    stop = threading.Event()
    with Client([d.endpoint for d in daemons], timeout=10) as client:
        result: list[list[tuple[np.ndarray, Future]]] = []
        driver = threading.Thread(target=lambda: result.append(drive(client, 60, 16, stop)))
        driver.start()
        wait_for(lambda: answered_ok(victim) > 50, what="the victim serving its share")
        victim.signal(9)  # SIGKILL, the supervisor only: a node gone without a word
        victim.wait(10)
        others = sum(answered_ok(d) for d in daemons if d is not victim)
        wait_for(lambda: sum(answered_ok(d) for d in daemons if d is not victim) > others + 200,
                 what="the others serving the victim's share")
        back = fleet.restart(victim)
        # It answered `unavailable` while it started, so it rests a few seconds before its probe.
        served_after_return = wait_for(lambda: answered_ok(back), timeout=20, what="traffic on the returned daemon")
        stop.set()
        driver.join()
        sent = result[0]
        for x, future in sent:  # every request answered ok (retried elsewhere), none wrong
            np.testing.assert_allclose(future.result(), reference(x), rtol=1e-5, atol=1e-6)
    assert served_after_return > 0, "the client did not go back to the daemon once it returned"


def test_a_daemon_that_sheds_load_gets_less_of_it(fleet, repo):
    *healthy, shedding = fleet.serving([
        fleet.start(repo, MLP, wait=False), fleet.start(repo, MLP, wait=False),
        fleet.start(repo, MLP, wait=False, queue={"max_size": 1024, "default_timeout_ms": 10000, "max_per_client": 1})])
    with Client([d.endpoint for d in (*healthy, shedding)], timeout=20) as client:
        sent = drive(client, seconds=3, concurrency=24)
        assert all(future.result() is not None for _, future in sent)
    statuses = shedding.status()["replies"]
    assert statuses.get("overloaded", 0) > 0, "the test did not overload the daemon"
    # Requests sent to each daemon, answered either way. Spread by fewest outstanding
    # alone, the shedding daemon would get more than its share: its quick refusals
    # keep its count of outstanding requests low.
    offered = sum(statuses.values())
    assert offered < 0.6 * min(answered_ok(d) for d in healthy), statuses


def test_a_host_name_stands_for_every_address_it_resolves_to(fleet, repo):
    daemon = fleet.start(repo, MLP)
    port = daemon.endpoint.rsplit(":", 1)[1]
    assert f"tcp://127.0.0.1:{port}" in resolve(f"tcp://localhost:{port}")
    assert resolve(daemon.endpoint) is None  # an address already
    assert resolve("ipc:///run/inferd/data.sock") is None
    assert resolve("tcp://no-such-host.invalid:5555") == []
    with Client(f"tcp://localhost:{port}", timeout=20) as client:
        assert client.infer("mlp", np.ones((1, 16), np.float32)).shape == (1, 4)


def test_a_name_that_does_not_resolve_times_out_saying_so():
    with Client("tcp://no-such-host.invalid:5555", timeout=0.3) as client:
        with pytest.raises(Timeout, match="no daemon reachable at tcp://no-such-host.invalid:5555 .did not resolve"):
            client.infer("m", X)


def test_an_endpoint_answering_unavailable_rests_while_the_other_serves(server_factory):
    draining = server_factory(lambda n, h, b: error(h, "unavailable", "draining"))
    serving = server_factory(lambda n, h, b: ok(h, X))
    retry = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02, jitter=0.0)
    with Client([draining.endpoint, serving.endpoint], timeout=5, retry=retry) as client:
        for _ in range(100):  # until both are connected and the draining one has had its first request
            np.testing.assert_array_equal(client.infer("m", X), X)
            if draining.headers:
                break
        for _ in range(60):
            np.testing.assert_array_equal(client.infer("m", X), X)
    # Its first answer sends it to rest for a second; after that, one probe at a time.
    assert 1 <= len(draining.headers) <= 3, len(draining.headers)
    assert len(serving.headers) >= 60


def test_a_dead_endpoint_costs_no_request(server_factory):
    serving = server_factory(lambda n, h, b: ok(h, X))
    with Client([f"tcp://127.0.0.1:{free_port()}", serving.endpoint], timeout=2) as client:
        futures = [client.submit("m", X) for _ in range(50)]
        for future in futures:
            np.testing.assert_array_equal(future.result(), X)


def rollout(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "deploy" / "rollout.py"), "--inferctl", str(BIN / "inferctl"),
                           "--model", "mlp", *argv], capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def rollout_running(*argv: str) -> Iterator[subprocess.Popen]:
    """The rollout script started, its output readable as it comes; killed if the test leaves early."""
    with subprocess.Popen([sys.executable, str(ROOT / "deploy" / "rollout.py"), "--inferctl", str(BIN / "inferctl"),
                           "--model", "mlp", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as running:
        try:
            yield running
        finally:
            running.kill()


def live_versions(daemons: list[Daemon]) -> list[str]:
    return [d.status()["models"]["mlp"]["live_version"] for d in daemons]


def test_rollout_switches_every_daemon_or_none(fleet, reload_repo, workdir):
    # The middle daemon has its own copy of the repository, where v3 is corrupt.
    odd_repo = workdir / "odd-repo"
    shutil.copytree(reload_repo, odd_repo)
    (odd_repo / "mlp" / "v3" / "model.pt").write_bytes(b"PK\x03\x04 not a TorchScript archive")
    daemons = fleet.serving([fleet.start(reload_repo, RELOAD_MLP, wait=False),
                             fleet.start(odd_repo, RELOAD_MLP, wait=False),
                             fleet.start(reload_repo, RELOAD_MLP, wait=False)])
    controls = [arg for d in daemons for arg in ("--control", d.control)]

    done = rollout("--version", "v2", *controls)
    assert done.returncode == 0, done.stderr
    assert live_versions(daemons) == ["v2", "v2", "v2"]
    assert "is live on all 3 daemon(s)" in done.stdout

    broken = rollout("--version", "corrupt", *controls)  # refused by the first daemon
    assert broken.returncode == 1
    assert "refused by" in broken.stderr and "0 daemon(s) rolled back" in broken.stderr
    assert live_versions(daemons) == ["v2", "v2", "v2"]

    partial = rollout("--version", "v3", *controls)  # the first switches, the second refuses
    assert partial.returncode == 1
    assert "1 daemon(s) rolled back" in partial.stderr, partial.stderr
    assert live_versions(daemons) == ["v2", "v2", "v2"]


def test_rollout_refuses_an_unreachable_fleet_before_changing_anything(fleet, reload_repo, workdir):
    daemon = fleet.start(reload_repo, RELOAD_MLP)
    done = rollout("--version", "v2", "--control", daemon.control, "--control", f"ipc://{workdir}/nobody.sock")
    assert done.returncode == 1
    assert "nobody.sock" in done.stderr and "Traceback" not in done.stderr
    assert live_versions([daemon]) == ["v1"]


FAKE_KUBECTL = '''#!{python}
"""kubectl for a fleet of local daemons: pods are names for control endpoints."""
import json, os, subprocess, sys
pods = json.loads(os.environ["FAKE_PODS"])
args = sys.argv[1:]
if args[:2] == ["get", "pods"]:
    items = [{{"metadata": {{"name": p}}, "spec": {{"nodeName": "node-" + p}}, "status": {{"phase": "Running"}}}}
             for p in pods]
    print(json.dumps({{"items": items}}))
elif args[0] == "exec":
    inferctl_args = args[args.index("--") + 2:]
    sys.exit(subprocess.run([os.environ["FAKE_INFERCTL"], "--control", pods[args[3]], *inferctl_args]).returncode)
else:
    sys.exit("fake kubectl: unexpected " + " ".join(args))
'''


def test_rollout_through_kubectl_reaches_each_pod(fleet, reload_repo, workdir, monkeypatch):
    odd_repo = workdir / "odd-repo"
    shutil.copytree(reload_repo, odd_repo)
    (odd_repo / "mlp" / "v3" / "model.pt").write_bytes(b"PK\x03\x04 not a TorchScript archive")
    daemons = fleet.serving([fleet.start(reload_repo, RELOAD_MLP, wait=False),
                             fleet.start(odd_repo, RELOAD_MLP, wait=False)])
    kubectl = workdir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
    kubectl.chmod(0o755)
    monkeypatch.setenv("FAKE_PODS", json.dumps({"inferd-a": daemons[0].control, "inferd-b": daemons[1].control}))
    monkeypatch.setenv("FAKE_INFERCTL", str(BIN / "inferctl"))

    done = rollout("--version", "v2", "--kubernetes", "--kubectl", str(kubectl))
    assert done.returncode == 0, done.stderr
    assert live_versions(daemons) == ["v2", "v2"]

    failed = rollout("--version", "v3", "--kubernetes", "--kubectl", str(kubectl))
    assert failed.returncode == 1 and "pod/inferd-b" in failed.stderr
    assert live_versions(daemons) == ["v2", "v2"]


def test_a_long_run_of_failures_keeps_the_rest_bounded(server_factory):
    # Thousands of `unavailable` answers in a row (a daemon starting slowly under a
    # patient client) must neither break the client nor rest the daemon past the cap.
    starting = server_factory(lambda n, h, b: error(h, "unavailable", "starting") if n <= 1100 else ok(h, X))
    patient = RetryPolicy(max_attempts=2000, initial_delay=0.0005, max_delay=0.001, jitter=0.0)
    with Client(starting.endpoint, timeout=60, retry=patient) as client:
        np.testing.assert_array_equal(client.infer("m", X), X)
    assert len(starting.headers) == 1101


def test_a_name_that_resolves_differently_adds_and_retires_endpoints():
    import zmq

    from inferd.client.endpoints import EndpointPool

    context = zmq.Context()
    pool = EndpointPool(context, ["tcp://localhost:5999"], lambda socket: None)
    try:
        name = "tcp://localhost:5999"
        assert "tcp://127.0.0.1:5999" in pool.endpoints
        added, retired = pool.update(name, ["tcp://10.0.0.1:5999", "tcp://127.0.0.1:5999"])
        assert [e.address for e in added] == ["tcp://10.0.0.1:5999"]
        added, retired = pool.update(name, ["tcp://10.0.0.1:5999"])
        assert not added and "tcp://127.0.0.1:5999" in [e.address for e in retired]
        assert all(e.retired for e in retired)
        assert pool.update(name, []) == ([], [])  # a failed lookup takes nothing away
        assert not pool.endpoints["tcp://10.0.0.1:5999"].retired
    finally:
        pool.close()
        context.term()


def test_an_address_given_as_such_outlives_the_names_that_resolved_to_it():
    import zmq

    from inferd.client.endpoints import EndpointPool

    context = zmq.Context()
    pool = EndpointPool(context, ["tcp://127.0.0.1:5998", "tcp://localhost:5998"], lambda socket: None)
    try:
        pool.update("tcp://localhost:5998", ["tcp://10.0.0.1:5998"])
        assert not pool.endpoints["tcp://127.0.0.1:5998"].retired
    finally:
        pool.close()
        context.term()


def test_rollout_undoes_a_reload_that_outlived_its_timeout(fleet, reload_repo, workdir):
    repo, gate = gated_reload_repo(reload_repo, workdir, "v1")
    daemon = fleet.start(repo, RELOAD_MLP)
    with rollout_running("--version", "gated", "--timeout", "2", "--control", daemon.control) as running:
        stopped = running.stderr.readline()
        assert "took more than 2 s" in stopped, stopped
        gate.open()  # the reload went on in the daemon; it ends now, and the script undoes it
        _, err = running.communicate(timeout=300)
    assert running.returncode == 1 and "1 daemon(s) rolled back" in err, err
    assert live_versions([daemon]) == ["v1"]
