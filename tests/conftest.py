"""Fixtures that start the real daemon: real processes, sockets, shared memory and models."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import models  # noqa: E402

from inferd import Client  # noqa: E402
from inferd.ipc.control import ControlClient, ControlError  # noqa: E402

START_TIMEOUT_S = 90


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def toml(value: dict[str, Any]) -> str:
    """The small subset of TOML the tests write: tables of scalars, lists and inline tables."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items()) + " }"
        raise TypeError(type(v))

    lines: list[str] = []

    def table(name: str, body: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        nested = {k: v for k, v in body.items() if isinstance(v, dict) and k != "inputs"}
        lines.extend(f"{k} = {scalar(v)}" for k, v in body.items() if k not in nested)
        for key, sub in nested.items():
            table(f"{name}.{key}", sub)

    for name, body in value.items():
        table(name, body)
    return "\n".join(lines) + "\n"


class Daemon:
    """An `inferd serve` process with its own folder, config and log."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir
        self.config = config
        self.config_path = workdir / "inferd.toml"
        self.config_path.write_text(toml(config))
        self.endpoint = config["server"]["listen"][0]
        self.control = config["server"]["control"]
        self.log_path = workdir / "daemon.log"
        self.process: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Daemon:
        """Start the daemon; with `wait`, return once `health` says it serves."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "inferd.cli", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=log, start_new_session=True,
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until the daemon reports healthy; fail with its log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            try:
                with ControlClient(self.control, timeout=1.0) as ctl:
                    if ctl.call("health")["healthy"]:
                        return
            except ControlError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"daemon not healthy within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the daemon has written to stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kwargs: Any) -> Client:
        """A Client connected to the daemon's first data endpoint."""
        kwargs.setdefault("timeout", 20.0)
        return Client(self.endpoint, **kwargs)

    def call(self, command: str, **args: Any) -> Any:
        """One control command."""
        with ControlClient(self.control, timeout=10.0) as ctl:
            return ctl.call(command, **args)

    def status(self) -> dict[str, Any]:
        """The `status` command's result."""
        return self.call("status")

    def signal(self, signum: int) -> None:
        """Send a signal to the supervisor only."""
        os.kill(self.process.pid, signum)

    def wait(self, timeout: float = 60) -> int:
        """Wait for the supervisor to exit; return its exit code."""
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, and wait for a clean exit."""
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill_all(self) -> None:
        """Kill the supervisor and every process of its session (the workers)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with every test model."""
    root = tmp_path_factory.mktemp("repo")
    models.build_repository(root)
    return root


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short folder under /tmp (ipc:// paths are limited to about 100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="inferd-t"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def base_config(workdir: Path, repo: Path, models_: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> dict[str, Any]:
    """A config serving `models_` from `repo`, with its sockets and state in `workdir`."""
    config: dict[str, Any] = {
        "server": {
            "listen": [f"tcp://127.0.0.1:{free_port()}"],
            "control": f"ipc://{workdir}/control.sock",
            "state_dir": str(workdir / "state"),
            "metrics": "",
        },
        "workers": {"devices": ["cpu"], "streams": 2, "shm_mb": 16, "cpu_threads": 1},
        "queue": {"max_size": 1024, "default_timeout_ms": 10000},
        "models": {},
    }
    for name, body in models_.items():
        config["models"][name] = {"repository": str(repo / name), **body}
    for section, values in sections.items():
        config[section].update(values)
    return config


MLP = {"inputs": [{"dtype": "float32", "shape": [models.MLP_IN]}], "max_batch_size": 16, "warmup_batch_sizes": [1, 16]}
PAIR = {"inputs": [{"dtype": "float32", "shape": [3, 4]}, {"dtype": "int64", "shape": [2]}], "max_batch_size": 8}
SLOW = {"inputs": [{"dtype": "float32", "shape": [models.SLOW_FEATURES]}], "max_batch_size": 4}
FAILING = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 4, "warmup_batch_sizes": [1]}


@pytest.fixture
def start_daemon(workdir: Path, repo: Path):
    """Start daemons in this test; every one is killed (with its workers) at the end."""
    started: list[Daemon] = []

    def start(models_: dict[str, dict[str, Any]], wait: bool = True, **sections: dict[str, Any]) -> Daemon:
        daemon = Daemon(workdir, base_config(workdir, repo, models_, **sections))
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.kill_all()


@pytest.fixture(scope="module")
def shared_daemon(repo: Path) -> Iterator[Daemon]:
    """One daemon for a whole module: mlp, pair, slow and failing on two CPU workers."""
    path = Path(tempfile.mkdtemp(prefix="inferd-m"))
    config = base_config(path, repo, {"mlp": MLP, "pair": PAIR, "slow": SLOW, "failing": FAILING},
                         workers={"devices": ["cpu", "cpu"]})
    config["server"]["listen"].append(f"ipc://{path}/data.sock")
    daemon = Daemon(path, config)
    daemon.start()
    yield daemon
    daemon.kill_all()
    shutil.rmtree(path, ignore_errors=True)
