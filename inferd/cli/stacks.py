"""The thread stacks of a daemon whose control socket does not answer, asked of its processes with SIGUSR1."""

from __future__ import annotations

import signal
import time
from typing import Any

from inferd.cli.common import CliError
from inferd.system.paths import RuntimeFiles

SIGNALLED_WAIT_S = 2.0


def signalled_stacks(files: RuntimeFiles) -> dict[str, Any]:
    """The stacks a hung daemon's processes write on SIGUSR1, read from their stacks files."""
    import psutil

    try:
        pid = int(files.pid.read_text())
        supervisor = psutil.Process(pid)
        titles = {child: child.cmdline()[0] for child in supervisor.children(recursive=True)}
        workers = {child: int(title.split()[1].removeprefix("worker"))
                   for child, title in titles.items() if title.startswith("inferd: worker")}
        # A Python model's process: `inferd: step MODEL.NUMBER`.
        steps = {child: title.split()[2].rpartition(".") for child, title in titles.items()
                 if title.startswith("inferd: step ")}
    except (OSError, ValueError, IndexError, psutil.Error) as exc:
        raise CliError(f"cannot find the daemon's processes from {files.pid}: {exc}") from None
    targets = {"supervisor": (supervisor, files.stacks),
               **{f"worker{i} (pid {p.pid})": (p, files.worker_stacks(i)) for p, i in workers.items()},
               **{f"step {model}.{number} (pid {p.pid})": (p, files.step_stacks(model, int(number)))
                  for p, (model, _, number) in steps.items()}}
    sizes = {name: path.stat().st_size if path.exists() else 0 for name, (_, path) in targets.items()}
    for process, _ in targets.values():
        try:
            process.send_signal(signal.SIGUSR1)
        except psutil.AccessDenied:
            raise CliError(f"cannot signal pid {process.pid}: run inferctl as root or as the daemon's user") from None
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + SIGNALLED_WAIT_S
    texts: dict[str, str] = {}
    while time.monotonic() < deadline and len(texts) < len(targets):
        time.sleep(0.05)
        for name, (_, path) in targets.items():
            if name not in texts and path.exists() and path.stat().st_size > sizes[name]:
                with open(path, errors="replace") as written:
                    written.seek(sizes[name])
                    texts[name] = written.read()
    return {"supervisor": texts.get("supervisor", "(no answer)"),
            "workers": {name: texts.get(name, "") for name in targets if name != "supervisor"}}
