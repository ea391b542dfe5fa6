"""A daemon run as a child process, for the demo, the tests and the benchmarks.

It writes the config, starts `inferd serve` in its own session (so the daemon
and its workers can be killed together), waits for `health`, and stops it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inferd.client.client import Client
from inferd.ipc.control import ControlClient, ControlError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def local_config(workdir: Path, models: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> dict[str, Any]:
    """A config for a daemon on this machine: one CPU worker, a loopback port the daemon picks
    (DaemonProcess reads it from `status` once the daemon is up), control socket and state in
    `workdir`, no metrics; `sections` update its tables."""
    config: dict[str, Any] = {
        "server": {
            "listen": ["tcp://127.0.0.1:0"],
            "control": f"ipc://{workdir}/control.sock",
            "state_dir": str(workdir / "state"),
            "metrics": "",
            "http": "",
            "grpc": "",
        },
        "workers": {"devices": ["cpu"], "streams": 2, "cpu_threads": 1},
        "queue": {},
        "models": models,
    }
    for section, values in sections.items():
        config[section].update(values)
    return config


def to_toml(config: dict[str, Any]) -> str:
    """A config dict as TOML: keys, then tables of scalars, lists and inline tables (what configs and a
    model folder's model.toml use)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"cannot write {type(v).__name__} as TOML")

    lines: list[str] = []

    def table(prefix: str, body: dict[str, Any]) -> None:
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        lines.extend(f"{k} = {value(v)}" for k, v in body.items() if k not in nested)
        for key, sub in nested.items():
            lines.append(f"[{prefix}{key}]")
            table(f"{prefix}{key}.", sub)

    table("", config)
    return "\n".join(lines) + "\n"


# `inferd serve` without its console script; -P keeps the current folder off sys.path, as for the console script.
SERVE = (sys.executable, "-P", "-m", "inferd.cli", "serve")


class DaemonProcess:
    """`inferd serve` as a child process, with its config and log in `workdir`; `command` runs it (by default
    SERVE), from the folder `cwd` (by default this process's), under `open_files`, the (soft, hard) limit on
    open files it starts with (prlimit sets it, as a shell's ulimit would; None: this process's)."""

    def __init__(self, workdir: Path, config: dict[str, Any] | None, control: str | None = None,
                 env: dict[str, str] | None = None, command: tuple[str, ...] = SERVE,
                 cwd: Path | None = None, open_files: tuple[int, int] | None = None) -> None:
        self.workdir = Path(workdir)
        self.command, self.cwd = command, cwd
        self.config = config
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = self.workdir / "inferd.toml"
            self.config_path.write_text(to_toml(config))
        # A port 0 is known once the daemon is up (wait_healthy reads it).
        self.endpoint = config["server"]["listen"][0] if config else "tcp://127.0.0.1:5555"
        self.control = control or (config["server"]["control"] if config else None)
        self.env = env
        self.open_files = open_files
        self.log_path = self.workdir / "daemon.log"
        self._process: subprocess.Popen | None = None

    @property
    def process(self) -> subprocess.Popen:
        """The `inferd serve` process (started)."""
        assert self._process is not None, "the daemon was not started"
        return self._process

    def start(self, wait: bool = True, timeout: float = 120) -> DaemonProcess:
        """Start the daemon; with `wait`, return once `health` says it serves."""
        listen = self.config["server"]["listen"] if self.config is not None else None
        if self._process is not None and listen and listen[0] != self.endpoint:
            # A restart listens where the daemon listened before (a port it picked): its clients know that one.
            listen[0] = self.endpoint
            assert self.config is not None and self.config_path is not None
            self.config_path.write_text(to_toml(self.config))
        argv = list(self.command)
        if self.open_files is not None:  # prlimit sets the limit, then runs the daemon in its place (same pid)
            argv = ["prlimit", f"--nofile={self.open_files[0]}:{self.open_files[1]}", "--", *argv]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True,
                                            cwd=self.cwd, env={**os.environ, **(self.env or {})})
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 120) -> None:
        """Block until the daemon reports healthy; raise with its log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.call("health", timeout=1.0)["healthy"]:
                    self.endpoint = self.status()["listen"][0]
                    return
            except ControlError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the daemon was not healthy within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the daemon has written to stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kwargs: Any) -> Client:
        """A Client connected to the daemon's first data endpoint."""
        kwargs.setdefault("timeout", 20.0)
        return Client(self.endpoint, **kwargs)

    def call(self, command: str, timeout: float = 10.0, **args: Any) -> Any:
        """One control command."""
        from inferd.system import paths

        with ControlClient(self.control or paths.find_control(), timeout=timeout) as ctl:
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
        if self._process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
