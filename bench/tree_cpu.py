"""The CPU time of a command and of every process it starts, the ones that outlive their parents included.

    python -m bench.tree_cpu -- python -m pytest -q -n 2 --dist loadfile -m "not serial"

A test run's daemons are killed with their process group, so their workers are never collected by the process
that started them and `time` misses their CPU. This process makes itself the subreaper of what the command
starts, collects every process that ends under it, and prints the command's exit status, its wall seconds and
the CPU seconds of all of them, as one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def main(command: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    began = time.monotonic()
    started = subprocess.Popen(command)
    status = 0
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        if pid == started.pid:
            status = os.waitstatus_to_exitcode(wait_status)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"command": command, "status": status, "wall_s": round(time.monotonic() - began, 1),
                      "cpu_s": round(used.ru_utime + used.ru_stime, 1)}))
    return status


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["--"] else args))
