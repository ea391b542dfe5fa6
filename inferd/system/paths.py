"""Where inferd keeps its sockets and state when the config does not say.

A daemon run by systemd (or by root) uses /run/inferd and /var/lib/inferd. An
unprivileged user who cannot write there gets a per-user runtime folder and
~/.local/state/inferd instead, and `inferctl` finds the daemon by the same rule,
so `inferd serve` in one terminal and `inferctl status` in another just work.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

SYSTEM_RUNTIME_DIR = Path("/run/inferd")
SYSTEM_STATE_DIR = Path("/var/lib/inferd")
CONTROL_SOCKET_NAME = "control.sock"
COMPILE_CACHE = "compile-cache"  # in state_dir: what torch.compile made for models with compile = "inductor"


def _writable(folder: Path) -> bool:
    """True when `folder` exists and can be written, or could be created in its parent."""
    if folder.exists():
        return os.access(folder, os.W_OK | os.X_OK)
    return os.access(folder.parent, os.W_OK | os.X_OK)


def user_runtime_dir() -> Path:
    """The per-user runtime folder: $XDG_RUNTIME_DIR/inferd, else /tmp/inferd-$UID."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "inferd"
    return Path(f"/tmp/inferd-{os.getuid()}")


def user_state_dir() -> Path:
    """The per-user state folder: $XDG_STATE_HOME/inferd, else ~/.local/state/inferd."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "inferd"


def runtime_dir() -> Path:
    """The runtime folder a daemon started now would use."""
    return SYSTEM_RUNTIME_DIR if _writable(SYSTEM_RUNTIME_DIR) else user_runtime_dir()


def state_dir() -> Path:
    """The state folder a daemon started now would use."""
    return SYSTEM_STATE_DIR if _writable(SYSTEM_STATE_DIR) else user_state_dir()


def default_control() -> str:
    """The control endpoint a daemon uses when its config names none."""
    return f"ipc://{runtime_dir() / CONTROL_SOCKET_NAME}"


def find_control() -> str:
    """The control endpoint `inferctl` tries when told nothing.

    An operator in the inferd group may not be able to write /run/inferd, yet the
    daemon's socket is there: an existing socket wins over the writability rule.
    """
    for folder in (SYSTEM_RUNTIME_DIR, user_runtime_dir()):
        if (folder / CONTROL_SOCKET_NAME).exists():
            return f"ipc://{folder / CONTROL_SOCKET_NAME}"
    return default_control()


class RuntimeFiles:
    """The files a running daemon keeps beside its control socket, named after it.

    With an ipc:// control endpoint they sit next to the socket (`control.sock.pid`,
    `control.sock.stacks`, ...), so `inferctl` finds them from the endpoint alone; with
    a tcp:// one they are named after the daemon's instance in the runtime folder.
    """

    def __init__(self, control: str, instance: str) -> None:
        ipc = control.startswith("ipc://")
        self.base = Path(control[len("ipc://"):]) if ipc else runtime_dir() / f"inferd-{instance}"
        self.control_socket: Path | None = self.base if ipc else None

    def _sibling(self, suffix: str) -> Path:
        return self.base.with_name(self.base.name + suffix)

    @property
    def backend(self) -> Path:
        """The ipc socket the workers talk to the supervisor on."""
        return self._sibling(".backend")

    @property
    def pid(self) -> Path:
        """Holds the supervisor's pid, for `inferctl stacks` when the control socket does not answer."""
        return self._sibling(".pid")

    @property
    def stacks(self) -> Path:
        """Where SIGUSR1 makes the supervisor write its thread stacks."""
        return self._sibling(".stacks")

    def upstream(self, protocol: str) -> Path:
        """The ipc socket the gateway sends the requests of `protocol` (http, grpc) to."""
        return self._sibling(f".{protocol}")

    def worker_stacks(self, worker: int) -> Path:
        """Where SIGUSR1 makes worker `worker` write its thread stacks."""
        return self._sibling(f".worker{worker}.stacks")

    def step_stacks(self, model: str, number: int) -> Path:
        """Where SIGUSR1 makes process `number` of Python model `model` write its thread stacks."""
        return self._sibling(f".step-{model}.{number}.stacks")

    @property
    def every_step_stacks(self) -> Path:
        """A glob of every step's stacks file (step_stacks), those of Python models added since too: its name
        the control socket's, escaped (a `[` in it matches itself), then `.step-*.stacks`."""
        return self.base.with_name(glob.escape(self.base.name) + ".step-*.stacks")
