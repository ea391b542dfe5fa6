"""Trim requests that reach a pod through its own annotations.

The fleet controller (inferd-fleet) cannot reach a pod's control socket, which
is ipc:// inside the pod, and exec-ing into pods is a right it should not
hold. It sets the annotation `inferd.io/trim-requested` instead; the kubelet
writes the pod's annotations into a downward-API file, and a new value there
asks every worker to trim, as `inferctl trim` does.
"""

from __future__ import annotations

import json
import logging
import os

TRIM_ANNOTATION = "inferd.io/trim-requested"
MISSING = (-1,)

log = logging.getLogger("inferd.supervisor")


def parse_annotations(text: str) -> dict[str, str]:
    """The downward API's annotations file: one `key="value"` per line, the value quoted as Go's %q does."""
    found = {}
    for line in text.splitlines():
        key, sep, quoted = line.partition("=")
        if not sep:
            continue
        try:
            value = json.loads(quoted)
        except ValueError:
            continue
        if isinstance(value, str):
            found[key] = value
    return found


class TrimRequests:
    """Watches one annotations file; `due` is true once for each new value of the trim annotation.

    The value found when the daemon starts (or when the file is first named) is
    taken as already handled: it asked the process this one replaces.
    """

    def __init__(self) -> None:
        self._path = ""
        self._stamp: tuple[int, ...] | None = None
        self._value: str | None = None

    def configure(self, path: str) -> None:
        """Watch `path` ("" for none) from now on."""
        if path != self._path:
            self._path = path
            self._stamp = None
            self._value = self._read() if path else None

    def due(self) -> str | None:
        """The annotation's value when it changed since the last look, else None."""
        if not self._path:
            return None
        previous = self._value
        self._value = self._read()
        return self._value if self._value is not None and self._value != previous else None

    def _read(self) -> str | None:
        try:
            status = os.stat(self._path)  # follows the kubelet's ..data link to the file it last wrote
        except OSError as exc:
            if self._stamp != MISSING:
                log.warning("cannot read the pod annotations in %s: %s", self._path, exc.strerror)
                self._stamp = MISSING
            return self._value
        stamp = (status.st_ino, status.st_mtime_ns, status.st_size)
        if stamp == self._stamp:
            return self._value
        self._stamp = stamp
        try:
            with open(self._path, encoding="utf-8", errors="replace") as file:
                return parse_annotations(file.read()).get(TRIM_ANNOTATION)
        except OSError as exc:
            log.warning("cannot read the pod annotations in %s: %s", self._path, exc.strerror)
            return self._value
