"""What the workers' fork server imports once, before it forks any worker.

Workers are forked from a fork server (multiprocessing's "forkserver": a fresh
interpreter of its own, started by the supervisor, holding none of its sockets
or threads) that has imported torch and the worker's modules: a worker started
after a crash, or one of the many workers of a machine of many devices, is
ready without its own import of torch (about 1.5 s of CPU each). The server
never touches a device, so no worker inherits a CUDA context: each makes its
own after the fork, as a spawned one would.
"""

from __future__ import annotations

import gc
import os

import setproctitle

from inferd.system import child

setproctitle.setproctitle("inferd: fork server")
child.fork_server = os.getpid()

# With them torch, imported once here for every worker forked from this process.
import torch  # noqa: E402

from inferd.worker import executor, main, runner  # noqa: E402, F401

# A process forked from one that has initialized CUDA cannot use it: were an import ever to, say so rather
# than start workers that fail on their first device call.
if torch.cuda.is_initialized():
    raise RuntimeError("importing the worker's modules initialized CUDA in the workers' fork server")

# What was imported lives as long as the workers: kept out of their collections, a collection in a worker
# never writes to (and so copies) the pages it shares with this process.
gc.freeze()
