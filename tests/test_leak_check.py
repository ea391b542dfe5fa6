"""The suite's leak check (conftest): it counts what the daemons this run started leave behind, and not what a
daemon someone else starts on the machine meanwhile holds."""

from __future__ import annotations

import secrets

import psutil
from conftest import MLP, RUN_MARKER, Daemon, _leftovers, _present, base_config, wait_for

from inferd.system import paths


def traces(daemon: Daemon) -> dict[str, set[str]]:
    """What a running daemon holds, by the leak check's places: its processes, its arenas, and the files beside
    its control socket in the runtime folder."""
    supervisor = psutil.Process(daemon.process.pid)
    titled = {str(p.pid) for p in [supervisor, *supervisor.children(recursive=True)]
              if (p.cmdline() or [""])[0].startswith("inferd:")}
    socket = daemon.control.removeprefix("ipc://").rsplit("/", 1)[1]
    runtime = paths.runtime_dir()
    return {"processes": titled,
            "/dev/shm": {name for name in _present()["/dev/shm"] if name.startswith(f"inferd-{supervisor.pid}-")},
            str(runtime): {p.name for p in runtime.glob(f"{socket}*")}}


def test_the_leak_check_counts_this_runs_daemons_and_not_anothers(workdir, repo, monkeypatch):
    before = _present()
    runtime = paths.runtime_dir()
    runtime.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(3)
    started = []
    # Both with their control socket in the runtime folder, as `inferd serve` with no config puts it.
    for name in ("ours", "another"):
        folder = workdir / name
        folder.mkdir()
        config = base_config(folder, repo, {"mlp": MLP}, server={"control": f"ipc://{runtime}/leaks-{name}-{token}"})
        started.append(Daemon(folder, config))
    ours, another = started
    try:
        ours.start()
        with monkeypatch.context() as outside:  # as a user's own daemon, in another terminal
            outside.delenv(RUN_MARKER)
            another.start()
        held = {name: traces(daemon) for name, daemon in zip(("ours", "another"), started)}
        for where in held["ours"]:
            assert held["ours"][where] and held["another"][where], (where, held)
        left = _leftovers(before)
        for where, what in held["ours"].items():
            assert what <= set(left.get(where, [])), (where, what, left)
        for where, what in held["another"].items():
            assert not what & set(left.get(where, [])), (where, what, left)
    finally:
        for daemon in started:
            daemon.kill_all()
    gone = {where: held["ours"][where] | held["another"][where] for where in held["ours"]}
    wait_for(lambda: not any(set(_present()[where]) & what for where, what in gone.items()),
             what="both daemons' traces cleaned up")
