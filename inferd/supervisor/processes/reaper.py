"""The reaper: a small process that outlives a supervisor killed outright, and removes what it left.

A supervisor that exits cleans up after itself; one killed with SIGKILL (or by
the OOM killer) cannot, and its arenas would hold /dev/shm until some later
start swept them. So before it opens anything, the supervisor forks this
process, in a session of its own (a kill of the daemon's process group does
not reach it). It waits on a pipe: a byte means the supervisor cleaned up and
it exits; end-of-file without one means the supervisor died, and it removes
the arenas, the workers' fork server's folder, the sockets nobody listens on
any more, and the pid and stacks files that still name the dead supervisor.
The arenas and the steps' stacks files are named by globs, expanded then: a
Python model a SIGHUP added has its processes' made after the fork.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import setproctitle

CLEAN = b"c"


def _listening(path: Path) -> bool:
    """True when some process accepts connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _names(path: Path, pid: int) -> bool:
    try:
        return path.read_text().strip() == str(pid)
    except OSError:
        return False


def _expand(patterns: list[Path]) -> list[Path]:
    """Each path whose name is a glob, as the paths it names now."""
    return [path for pattern in patterns for path in sorted(pattern.parent.glob(pattern.name))]


def _reap(read_fd: int, supervisor: int, arenas: list[Path], sockets: list[Path], pid_file: Path,
          files: list[Path], file_globs: list[Path], folders: list[Path]) -> None:
    if os.read(read_fd, 1) == CLEAN:
        return
    removed = []
    for folder in folders:
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    for path in _expand(arenas):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    # A daemon started since on the same control socket owns these now: it listens, and its pid is in the file.
    for path in sockets:
        if path.exists() and not _listening(path):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if _names(pid_file, supervisor):
        for path in [pid_file, *files, *_expand(file_globs)]:
            if path.exists():
                path.unlink(missing_ok=True)
                removed.append(path.name)
    if removed:
        print(f"inferd reaper: supervisor {supervisor} died; removed {', '.join(removed)}", file=sys.stderr,
              flush=True)


class Reaper:
    """The parent's handle on its reaper process."""

    def __init__(self) -> None:
        self._write_fd: int | None = None
        self.pid: int | None = None

    def start(self, arenas: list[Path], sockets: list[Path], pid_file: Path, files: list[Path],
              file_globs: list[Path], folders: list[Path]) -> None:
        """Fork the reaper; call before any thread or socket exists in this process. The names of `arenas` and
        `file_globs` are globs (see _expand); `folders` are private to this supervisor, removed whole."""
        read_fd, write_fd = os.pipe()
        supervisor = os.getpid()
        pid = os.fork()
        if pid == 0:  # the reaper
            try:
                os.close(write_fd)
                os.setsid()
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # held for the supervisor as it starts
                os.closerange(3, read_fd)
                os.closerange(read_fd + 1, os.sysconf("SC_OPEN_MAX"))
                setproctitle.setproctitle(f"inferd: reaper of {supervisor}")
                _reap(read_fd, supervisor, arenas, sockets, pid_file, files, file_globs, folders)
            finally:
                os._exit(0)
        os.close(read_fd)
        self._write_fd, self.pid = write_fd, pid

    def release(self) -> None:
        """The supervisor has cleaned up: the reaper exits without touching anything."""
        if self._write_fd is None or self.pid is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._write_fd, CLEAN)
        os.close(self._write_fd)
        os.waitpid(self.pid, 0)
        self._write_fd = self.pid = None
