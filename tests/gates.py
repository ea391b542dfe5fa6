"""Gates: batches of the test model `variable` held, taking no CPU, until the test lets them through.

Given a batch whose first value is -n, `variable` (tests/models.py) saves the batch to the file `n` of the
repository's gates folder. Where the test has made that file a named pipe, the save waits in open() until a
reader comes, so the executor stays busy for as long as the test needs and not a moment longer. A busy loop
would instead hold a core for a guessed time, a core the tests running beside it need.
"""

from __future__ import annotations

import os
import random
import select
import time
from pathlib import Path

import numpy as np

MAX_GATE = 1 << 24  # float32 holds every whole number below this exactly


class Gate:
    """One named pipe in `folder`: a batch whose first row is `gate.input` waits at it until `open`; or, with
    `name`, the pipe of that name, at which whatever saves to it (tests/models.py's WarmsAtGate) waits."""

    def __init__(self, folder: Path, name: str | None = None) -> None:
        while True:
            number = random.randrange(1, MAX_GATE)
            path = folder / (name or str(number))
            try:
                os.mkfifo(path, 0o600)
            except FileExistsError:
                if name is not None:
                    raise
                continue
            break
        self.number, self.path = number, path
        self.input = np.array([[-number, 0]], dtype=np.float32)

    def open(self, timeout: float = 30.0) -> None:
        """Let the batch waiting at the gate through, or the first to come within `timeout` s, and return once
        it has passed. The gate is gone then: a batch sent to it later does not wait."""
        reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                assert left > 0, f"no batch came to gate {self.number} within {timeout:g} s"
                # Linux reports a pipe no writer ever opened as not readable, so this waits for the batch.
                readable, _, _ = select.select([reader], [], [], left)
                if readable and not os.read(reader, 1 << 16):
                    return  # the batch wrote all it writes and closed its end: it has passed
        finally:
            self.close()
            os.close(reader)

    def close(self) -> None:
        """Remove the gate. A batch already waiting at it waits until its worker is killed."""
        self.path.unlink(missing_ok=True)
