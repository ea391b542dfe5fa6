"""The mailbox through which other threads hand the client's I/O thread its work."""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

from inferd.client.call import Call


@dataclass(frozen=True)
class Cancel:
    """A call whose future was cancelled: the daemon is to be told."""

    call_id: int


class Mailbox:
    """What other threads hand the I/O thread: calls, DNS answers, and None to stop.

    Once the I/O thread stops it shuts the mailbox before taking what is left, so
    nothing posted later is lost unanswered: the post is refused instead.
    """

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._open = True

    def post(self, item: Call | Cancel | tuple[str, list[str]] | None) -> bool:
        """Hand `item` over and wake the I/O thread; False once the mailbox is shut."""
        with self._lock:
            if not self._open:
                return False
            self.items.put(item)
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the I/O thread has a wake-up pending, and takes every item
            return True

    def shut(self) -> None:
        """Refuse every later post."""
        with self._lock:
            self._open = False

    def close(self) -> None:
        """Shut, and close the wake pipe (after the I/O thread has stopped)."""
        with self._lock:
            if self._wake_w != -1:
                self._open = False
                os.close(self.wake_r)
                os.close(self._wake_w)
                self._wake_w = -1
