"""Fixtures that start the real daemon: real processes, sockets, shared memory and models."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import models
import python_models
from gates import Gate
from wire import RawPeer, ScriptedServer

from inferd.arrays import from_numpy, to_numpy
from inferd.harness import DaemonProcess, local_config
from inferd.system import paths
from inferd.system.shm_names import SHM_DIR

START_TIMEOUT_S = 90


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "the condition",
             every: float = 0.02) -> Any:
    """Poll `predicate` until it returns something true, and return that; fail the test with
    `what` if it has not within `timeout` seconds. Tests wait for a condition, never a guessed time."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(every)


def until(moment: float) -> None:
    """Wait until the monotonic clock reads `moment`: for a deadline the test set to come near, or pass."""
    wait_for(lambda: time.monotonic() >= moment, timeout=max(0.0, moment - time.monotonic()) + 5,
             what="the moment", every=0.005)


def exited(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie its parent has not collected yet counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# The files that take longest (seconds of test time each, measured with --durations=0), run first: xdist
# hands out files in order, so the workers then end together rather than one finishing a long file alone.
LONGEST_FIRST = ("test_formats.py", "test_reliability.py", "test_scaleout.py", "test_faults.py", "test_reload.py",
                 "test_lifecycle.py", "test_promises.py", "test_oip_connections.py", "test_canary.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files longest first; skip tests marked `gpu` where CUDA is not available."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, as written
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# This run's mark, in the environment of every process it starts (pytest-xdist's workers, the daemons, and
# theirs, which inherit it): the leak check counts what carries it, not a daemon someone else starts meanwhile.
# SPT_NOENV keeps setproctitle from writing a daemon process's title over its environment, where the check reads
# the mark (the title then has its command line's room, which holds every title inferd gives).
RUN_MARKER = "INFERD_TEST_RUN"
os.environ.setdefault(RUN_MARKER, secrets.token_hex(8))
os.environ["SPT_NOENV"] = "1"
# The pid in a name: an arena's supervisor, a client region's maker, a daemon with a tcp:// control's runtime files.
OWNER_IN_NAME = re.compile(r"^inferd-(?:client-)?(\d+)-")


def _started_by_this_run(pid: int | None) -> bool:
    """Whether process `pid` is this run's: this process, or one whose environment carries the run's mark. What
    a process that is gone left (or a file that names none) counts: nothing tells whose it was."""
    if pid is None or pid == os.getpid():
        return True
    try:
        return psutil.Process(pid).environ().get(RUN_MARKER) == os.environ[RUN_MARKER]
    except psutil.NoSuchProcess:  # a zombie too
        return True
    except psutil.AccessDenied:  # another user's
        return False


def _owners(folder: Path, pattern: str) -> dict[str, int | None]:
    """The files of `folder` that match `pattern`, each with the pid of the process that made it: named in it, or
    in the BASE.pid file whose BASE its name starts with (the files beside a daemon's ipc:// control socket)."""
    names = [p.name for p in folder.glob(pattern)] if folder.is_dir() else []
    pids: dict[str, int] = {}
    for name in names:
        if name.endswith(".pid"):
            with contextlib.suppress(OSError, ValueError):
                pids[name.removesuffix(".pid")] = int((folder / name).read_text())

    def owner(name: str) -> int | None:
        if named := OWNER_IN_NAME.match(name):
            return int(named.group(1))
        return next((pid for base, pid in pids.items() if name == base or name.startswith(base + ".")), None)

    return {name: owner(name) for name in names}


def _inferd_processes() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("inferd:")}


def _present() -> dict[str, dict[str, int | None]]:
    """The daemons' traces, by place: each with the pid of the process that made it (None: unknown)."""
    runtime = paths.runtime_dir()
    return {
        "/dev/shm": _owners(SHM_DIR, "inferd-*"),
        str(runtime): _owners(runtime, "*"),
        "processes": {str(pid): pid for pid in _inferd_processes()},
    }


def _leftovers(before: dict[str, dict[str, int | None]]) -> dict[str, list[str]]:
    """What this run's processes made since `before` and left, by place (those with nothing left are left out)."""
    left = {where: sorted(what for what, pid in found.items()
                          if what not in before.get(where, {}) and _started_by_this_run(pid))
            for where, found in _present().items()}
    return {where: what for where, what in left.items() if what}


_BEFORE = pytest.StashKey[dict[str, dict[str, int | None]]]()


def _runs_tests_itself(config: pytest.Config) -> bool:
    """Whether this process is the whole run: not one of pytest-xdist's workers, which see each other's
    daemons and arenas; the process that started them checks after every one has ended."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _runs_tests_itself(session.config):
        session.config.stash[_BEFORE] = _present()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves /dev/shm, the runtime folder and the process table as it found them."""
    if not _runs_tests_itself(session.config):
        return
    before = session.config.stash[_BEFORE]
    # A killed daemon's reaper cleans up a moment after the kill; give it that moment.
    deadline = time.monotonic() + 15
    while (left := _leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", "the tests left these behind: " + "; ".join(
                f"{where}: {what}" for where, what in left.items()), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def requests_accounted(daemon: DaemonProcess) -> int:
    """Requests the daemon has read: answered, waiting in its queue, or in a batch it runs. What a
    client sent but ZeroMQ still holds unread is not among them."""
    status = daemon.status()
    return (sum(status["replies"].values()) + sum(m["queue_depth"] for m in status["models"].values())
            + sum(w["requests_in_flight"] for w in status["workers"]))


class Daemon(DaemonProcess):
    """A daemon under test; its start waits at most START_TIMEOUT_S and fails the test with the log."""

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        try:
            super().wait_healthy(timeout)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None


def built_once(factory: pytest.TempPathFactory, config: pytest.Config, name: str,
               build: Callable[[Path], Any]) -> Path:
    """The folder `name`, built by `build` once per run: pytest-xdist's workers share one temporary
    root, and the first to take the lock builds while the others wait for it."""
    base = factory.getbasetemp()
    if not _runs_tests_itself(config):
        base = base.parent
    root = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            (root / ".built").touch()
    return root


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """A model repository with every test model (read-only: tests that change one copy it)."""
    return built_once(tmp_path_factory, pytestconfig, "repo", models.build_repository)


TESTS_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferd-tests"
# Inductor's compile cache, shared by every daemon of the run (a worker keeps the folder its environment names)
# and by later runs: in a fresh one, a worker's first load of an AOTInductor package compiles inductor's probes
# of the CPU's instruction sets first, some 14 s of a C++ compiler's time. (torch sets this itself, in this
# process, once it has compiled or loaded a package: set here, it is the same for the daemons of every test.)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(TESTS_CACHE / f"inductor-{torch.__version__}")


def cached_across_runs(root: Path, build: Callable[[Path], Any]) -> None:
    """Build into `root` what takes minutes to build (AOTInductor packages), or copy it from the build of an
    earlier run: kept in the user's cache folder, under the torch version and the source of the test
    models, so a change to either builds it again."""
    source = (Path(__file__).parent / "models.py").read_bytes()
    key = hashlib.sha256(torch.__version__.encode() + b"\0" + source).hexdigest()[:16]
    cache = TESTS_CACHE / f"{root.name}-{key}"
    if cache.is_dir():
        shutil.copytree(cache, root, dirs_exist_ok=True)
        return
    build(root)
    staging = cache.with_name(cache.name + f".{os.getpid()}")
    shutil.copytree(root, staging)
    try:
        staging.rename(cache)
    except OSError:  # another run cached it first
        shutil.rmtree(staging, ignore_errors=True)


@pytest.fixture(scope="session")
def python_repo(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """The Python models of tests/python_models.py (read-only)."""
    return built_once(tmp_path_factory, pytestconfig, "python-repo", python_models.build_python_repository)


@pytest.fixture(scope="session")
def formats_repo(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """One model `mlp` in every format: TorchScript v1, torch.export v2, AOTInductor v3 (read-only)."""
    return built_once(tmp_path_factory, pytestconfig, "formats-repo",
                      lambda root: cached_across_runs(root, models.build_formats_repository))


@pytest.fixture(scope="session")
def reload_repo(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """One model `mlp` in many versions, good and bad, for reload tests (read-only, as `repo`)."""
    return built_once(tmp_path_factory, pytestconfig, "reload-repo", models.build_reload_repository)


@pytest.fixture(scope="session")
def references(reload_repo: Path):
    """Each good version's model, in this process, by version name."""
    return {v: torch.jit.load(str(reload_repo / "mlp" / v / "model.pt")) for v in ("v1", "v2", "v3")}


def replies_across_a_worker_death(daemon: Daemon, gate: Gate, signum: int) -> list[dict[str, Any]]:
    """The replies to 100 requests of `variable` (ONE_AT_A_TIME, one executor) across the death of the only
    worker by `signum`: it dies with the first held at `gate`, one stacked behind it and the rest queued (a long
    deadline); the held batch, computed again once the worker is back, waits at the gate until it opens."""
    with RawPeer(daemon.endpoint) as peer:
        peer.send(0, "variable", [gate.input], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["workers"][0]["executors_busy"], what="the executor held")
        for index in range(1, 100):
            peer.send(index, "variable", [np.full((1, 2), 10, dtype=np.float32)], timeout_ms=60_000)
        wait_for(lambda: daemon.status()["models"]["variable"]["queue_depth"] >= 98, what="the rest queued")
        os.kill(daemon.status()["workers"][0]["pid"], signum)
        gate.open()
        replies = [peer.recv(timeout=60)[0] for _ in range(100)]
        assert peer.nothing_more()
    return replies


@contextlib.contextmanager
def pipeline_held(daemon: Daemon, gates: Callable[[], Gate], send: Callable[[Gate, bool], Any],
                  worker: Callable[[], dict[str, Any]] | None = None) -> Iterator[None]:
    """Keep one executor busy, and the place behind it taken, until the block ends: `send(gate, full)` sends
    a batch that waits at `gate`, first one that runs, then a full one (which goes behind a running batch at
    once). So what the test sends meanwhile all waits in the queue, however the batcher sees it arrive: a
    batch that filled up as the requests came would otherwise go behind the running one, and to an idle
    executor each would go as it came. `worker`: the status of the process held (default: the first
    worker's; a Python model's process: `step_of`)."""
    status = worker or (lambda: daemon.status()["workers"][0])
    running, behind = gates(), gates()
    held = [send(running, False)]
    try:
        wait_for(lambda: status()["executors_busy"], what="the executor held")
        held.append(send(behind, True))
        wait_for(lambda: status()["batches_in_flight"] == 2, what="a batch held behind it")
        yield
    finally:
        running.open()
        behind.open()
    for future in held:
        if future is not None:
            future.result()


def sent_while_held(daemon: Daemon, model: str, sent: Sequence[Any], held_batch: Callable[[Gate, int], Any],
                    gates: Path) -> dict[Any, tuple[dict[str, Any], list[Any]]]:
    """Send `sent` to Python model `model` (request i with id i) while its one process is held (pipeline_held,
    with batches `held_batch(gate, rows)` waiting at gates made in `gates`), so that they wait in the queue
    together and go as one batch once it is let go; every reply by id, the two held batches' included."""
    with RawPeer(daemon.endpoint) as peer:
        def hold(gate: Gate, full: bool) -> None:
            peer.send(f"gate{gate.number}", model, [held_batch(gate, 8 if full else 1)], timeout_ms=60_000)

        with pipeline_held(daemon, lambda: Gate(gates), hold, lambda: step_of(daemon, model)):
            for index, x in enumerate(sent):
                peer.send(index, model, [x], timeout_ms=60_000)
            wait_for(lambda: daemon.status()["models"][model]["queue_depth"] == len(sent),
                     what=f"the {len(sent)} queued")
        replies = {}
        while len(replies) < len(sent) + 2:
            header, outputs = peer.recv(timeout=30)
            replies[header["id"]] = (header, outputs)
    return replies


def step_of(daemon: Daemon, model: str) -> dict[str, Any]:
    """The status of the (first) process that runs Python model `model`."""
    return next(w for w in daemon.status()["workers"] if w.get("model") == model)


def held_reload_repo(reload_repo: Path, folder: Path, *versions: str) -> tuple[Path, Path]:
    """A repository in `folder` with the reload repository's mlp `versions` and a v1 that saves each warm-up
    batch to the file returned (where no gate is made there, it saves it and goes on; see hold_boots)."""
    repo, hold = folder / "held-repo", folder / "hold"
    for version in versions:
        shutil.copytree(reload_repo / "mlp" / version, repo / "mlp" / version)
    models.save_gated_version(repo, "v1", hold)
    return repo, hold


def hold_boots(hold: Path) -> Gate:
    """From now on, a worker that warms up held_reload_repo's v1 (one booting) waits at a gate at `hold` until
    the test opens it."""
    hold.unlink(missing_ok=True)  # where the warm-ups so far saved their batches
    return Gate(hold.parent, hold.name)


def gated_reload_repo(reload_repo: Path, folder: Path, *versions: str) -> tuple[Path, Gate]:
    """A repository in `folder` with the reload repository's mlp `versions` and a version `gated` whose
    warm-up, and so any load of it, waits at the gate returned until the test opens it."""
    repo = folder / "gated-repo"
    for version in versions:
        shutil.copytree(reload_repo / "mlp" / version, repo / "mlp" / version)
    gate = Gate(folder)
    models.save_gated_version(repo, "gated", gate.path)
    return repo, gate


@pytest.fixture
def reload_daemon(workdir: Path, reload_repo: Path):
    """Start daemons serving the reload repository (or `repo`); each is killed at the end of the test."""
    started: list[Daemon] = []

    def start(directory: Path = workdir, model: dict | None = None, repo: Path = reload_repo, **sections) -> Daemon:
        daemon = Daemon(directory, base_config(directory, repo, {"mlp": model or RELOAD_MLP}, **sections))
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill_all()


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short folder under /tmp (ipc:// paths are limited to about 100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="inferd-t"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def base_config(workdir: Path, repo: Path, models_: dict[str, dict[str, Any]],
                **sections: dict[str, Any]) -> dict[str, Any]:
    """A config serving `models_` from `repo`, with its sockets and state in `workdir`."""
    served = {name: {"repository": str(repo / name), **body} for name, body in models_.items()}
    config = local_config(workdir, served, workers={"shm_mb": 16},
                          queue={"max_size": 1024, "default_timeout_ms": 10000})
    for section, values in sections.items():
        config[section].update(values)
    return config


MLP = {"inputs": [{"dtype": "float32", "shape": [models.MLP_IN]}], "max_batch_size": 16, "warmup_batch_sizes": [1, 16]}
PAIR = {"inputs": [{"dtype": "float32", "shape": [3, 4]}, {"dtype": "int64", "shape": [2]}], "max_batch_size": 8}
SLOW = {"inputs": [{"dtype": "float32", "shape": [models.SLOW_FEATURES]}], "max_batch_size": 4}
RELOAD_MLP = {**MLP, "version": "v1"}  # the reload repository's mlp, pinned to its first version
NAMED_PAIR = {"inputs": [{"dtype": "float32", "shape": [3, 4], "name": "a"},
                         {"dtype": "int64", "shape": [2], "name": "b"}],
              "outputs": [{"name": "scaled"}, {"name": "doubled"}], "max_batch_size": 8}
# `variable` with one sample at a time, so that a batch held at a gate holds no other request.
ONE_AT_A_TIME = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 1, "warmup_batch_sizes": [1]}
FAILING = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}
BF16 = {"inputs": [{"dtype": "bfloat16", "shape": [models.BF16_FEATURES]}], "max_batch_size": 8,
        "warmup_batch_sizes": [1, 8]}


@pytest.fixture
def gates(repo: Path) -> Iterator[Callable[[], Gate]]:
    """Make gates at which batches of `variable` wait until the test opens them (tests/gates.py); those
    the test left closed are removed at its end."""
    made: list[Gate] = []

    def make() -> Gate:
        made.append(Gate(repo / models.GATES))
        return made[-1]

    yield make
    for gate in made:
        gate.close()


@pytest.fixture
def start_daemon(workdir: Path, repo: Path):
    """Start daemons in this test; every one is killed (with its workers) at the end."""
    started: list[Daemon] = []

    def start(models_: dict[str, dict[str, Any]], wait: bool = True, open_files: tuple[int, int] | None = None,
              **sections: dict[str, Any]) -> Daemon:
        daemon = Daemon(workdir, base_config(workdir, repo, models_, **sections), open_files=open_files)
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.kill_all()


@contextlib.contextmanager
def module_daemon(repo: Path, models_: dict[str, dict[str, Any]],
                  adjust: Callable[[dict[str, Any], Path], None] | None = None,
                  **sections: dict[str, Any]) -> Iterator[Daemon]:
    """A daemon for the tests of a module that leave it as they found it (a daemon start costs a worker's
    import of torch: the suite's largest cost), in a short folder of its own; `adjust(config, folder)`
    changes its config before it starts."""
    path = Path(tempfile.mkdtemp(prefix="inferd-m"))
    config = base_config(path, repo, models_, **sections)
    if adjust is not None:
        adjust(config, path)
    daemon = Daemon(path, config)
    try:
        yield daemon.start()
    finally:
        daemon.kill_all()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_daemon(repo: Path) -> Iterator[Daemon]:
    """One daemon for a whole module: mlp, pair, slow and failing on two CPU workers, on an ipc endpoint too."""

    def ipc_too(config: dict[str, Any], folder: Path) -> None:
        config["server"]["listen"].append(f"ipc://{folder}/data.sock")

    with module_daemon(repo, {"mlp": MLP, "pair": PAIR, "slow": SLOW, "failing": FAILING}, ipc_too,
                       workers={"devices": ["cpu", "cpu"]}) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def oip_daemon(repo: Path) -> Iterator[Daemon]:
    """One daemon for a whole module serving mlp, pair (with named tensors), failing, bf16 and untouched (mlp
    again, which no test calls) over ZeroMQ and the Open Inference Protocol over HTTP and gRPC, with metrics."""
    from inferd.harness import free_port

    served = {"mlp": MLP, "pair": NAMED_PAIR, "failing": FAILING, "bf16": {**BF16, "precision": "fp32"},
              "untouched": {**MLP, "repository": str(repo / "mlp")}}  # no test sends `untouched` a request
    with module_daemon(repo, served, server={"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}",
                                             "metrics": f"127.0.0.1:{free_port()}",
                                             "http_allowed_hosts": ["Inferd.Internal"]}) as daemon:
        yield daemon


def reference(repo: Path, name: str, version: str) -> Callable[..., Any]:
    """The model `name` at `version` from the test repository, run in this process: numpy in, numpy out."""
    module = torch.jit.load(str(repo / name / version / "model.pt"))

    def run(*arrays: np.ndarray) -> Any:
        with torch.inference_mode():
            out = module(*(from_numpy(a) for a in arrays))
        return tuple(to_numpy(o) for o in out) if isinstance(out, tuple) else to_numpy(out)

    return run


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ScriptedServer]]:
    """Make scripted servers (wire.ScriptedServer); each is closed at the end of the test."""
    servers: list[ScriptedServer] = []

    def make(answer):
        servers.append(ScriptedServer(answer))
        return servers[-1]

    yield make
    for server in servers:
        server.close()
