"""A process out of descriptors: which limit it met, and what the operator raises, in the words every part of
the daemon logs it with (the supervisor's client sockets, the gateways' listeners)."""

from __future__ import annotations

import errno
import os
import resource

RAISE_LIMIT = ("raise LimitNOFILE= in the daemon's systemd unit, or the hard limit (ulimit -Hn) of the shell that "
               "starts it")


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
    """What has run out, for lacking()'s answer ('EMFILE' or 'ENFILE'), and how to raise it."""
    if why == "ENFILE":
        return "the system has no file descriptor left; raise fs.file-max (sysctl)"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"this process has all {soft} descriptors its limit allows open (RLIMIT_NOFILE; the hard limit is "
            f"{hard}); {RAISE_LIMIT}")
