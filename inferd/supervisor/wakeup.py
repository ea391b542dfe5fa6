"""How other threads and signals reach the supervisor's loop: a self-pipe the loop polls.

Signal handlers run between any two bytecodes, so they only queue the signal
(no logging, no I/O); other threads queue a callback. Either writes a byte to
the pipe, which wakes the loop; the loop then runs each in its own thread.
SIGUSR1 is the exception that must work even when the loop is hung:
faulthandler writes every thread's stack to a file from the signal itself, then
the queued handler copies them to the log once the loop runs.
"""

from __future__ import annotations

import faulthandler
import signal
import socket
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

# The signals the supervisor handles. Each one's default action would end the process.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

# Signals that came before a Wakeup was installed, in their order.
_held: deque[int] = deque()


def hold_signals() -> None:
    """From a start's first moment, queue SIGNALS until the loop's handlers take them: a `systemctl reload` or
    a stop that comes while the daemon imports would otherwise end it before it has served or cleaned up."""
    for signum in SIGNALS:
        signal.signal(signum, lambda signum, frame: _held.append(signum))


class Wakeup:
    """The loop's self-pipe, the signals and callbacks waiting on it, and the SIGUSR1 stacks file."""

    def __init__(self, stacks: Path) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._signals: deque[int] = deque()
        self._callbacks: deque[Callable[[], None]] = deque()
        self._stacks_path = stacks
        self._stacks: IO[str] | None = None
        self._stacks_logged = 0

    def fileno(self) -> int:
        """The fd the loop polls."""
        return self._read.fileno()

    def install(self) -> None:
        """Queue SIGNALS from now on (SIGUSR1 writes the stacks first), after those hold_signals held."""
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for signum in SIGNALS:
            signal.signal(signum, self._queue_signal)
        self._stacks = open(self._stacks_path, "w")  # noqa: SIM115 - open for the life of the process
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=True)
        # Nothing is held from here on: the handlers above queue to this Wakeup.
        self._signals.extendleft(reversed(_held))
        _held.clear()
        if self._signals:
            self._write.send(b"\0")

    def _queue_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop's thread; any thread may call this."""
        self._callbacks.append(callback)
        try:
            self._write.send(b"\0")
        except BlockingIOError:
            pass  # the loop has wake-ups pending already

    def take(self) -> tuple[list[int], list[Callable[[], None]]]:
        """On the loop's thread, once the fd is readable: the signals and callbacks that came."""
        try:
            while self._read.recv(4096):
                pass
        except BlockingIOError:
            pass
        signals, callbacks = [], []
        while self._signals:
            signals.append(self._signals.popleft())
        while self._callbacks:
            callbacks.append(self._callbacks.popleft())
        return signals, callbacks

    def new_stacks(self) -> str:
        """What SIGUSR1 wrote to the stacks file since the last call."""
        with open(self._stacks_path, errors="replace") as written:
            written.seek(self._stacks_logged)
            stacks = written.read()
            self._stacks_logged = written.tell()
        return stacks

    def close(self) -> None:
        """Restore the signals' default wake-up and close the pipe and the stacks file."""
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
            self._stacks_path.unlink(missing_ok=True)
        signal.set_wakeup_fd(-1)
        self._read.close()
        self._write.close()
