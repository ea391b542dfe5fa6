"""The supervisor's open-files limit: each client connection holds a descriptor.

A shell's soft limit is often 1,024, under a hard limit many times that; the
supervisor raises the soft limit to the hard one as it starts (its children
inherit it), and says what it has. When the descriptors run out, ZeroMQ cannot
accept a connection: the client waits, unanswered, until one closes.
"""

from __future__ import annotations

import errno
import logging
import os
import resource

log = logging.getLogger("inferd.supervisor")


def raise_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit, and log the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.info("open files: at most %d (the hard limit)", soft)
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files: at most %d; the hard limit %d could not be taken (%s)", soft, hard, exc)
        return
    log.info("open files: at most %d (raised from %d to the hard limit)", hard, soft)


def lacking(fd: int) -> str | None:
    """Why no descriptor is left now (`fd`, an open one, is duplicated to find out): 'EMFILE' (this process
    has all its limit allows) or 'ENFILE' (the system has none); None while one is left, or if `fd` is not
    open after all."""
    try:
        os.close(os.dup(fd))
    except OSError as exc:
        return errno.errorcode[exc.errno] if exc.errno in (errno.EMFILE, errno.ENFILE) else None
    return None


def advice(why: str) -> str:
    """What has run out, for lacking()'s answer, and how to raise it."""
    if why == "ENFILE":
        return "the system has no file descriptor left; raise fs.file-max (sysctl)"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"the daemon has all {soft} descriptors its limit allows open (RLIMIT_NOFILE; the hard limit is {hard}); "
            "raise LimitNOFILE= in its systemd unit, or the hard limit (ulimit -Hn) of the shell that starts it")
