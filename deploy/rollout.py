#!/usr/bin/env python3
"""Roll a model version out across a fleet of inferd daemons, one daemon at a time.

Each daemon goes blue-green to the new version with `inferctl reload`; the
first daemon that refuses it stops the rollout, and every daemon already
switched goes back to the version it served before. The fleet is a list of
control endpoints (`--control`, once per daemon) or the pods of a Kubernetes
Deployment (`--kubernetes`, through `kubectl exec`).

Only the standard library, so it runs wherever python3 and kubectl do; inferd
itself need not be installed there in Kubernetes mode.

    deploy/rollout.py --model mlp --version v7 --kubernetes --namespace inferd
    deploy/rollout.py --model mlp --version v7 --control ipc:///run/inferd-0/control.sock \\
        --control ipc:///run/inferd-1/control.sock
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass

STATUS_TIMEOUT_S = 30  # inferctl status answers at once; only a wedged daemon takes this long
SETTLE_WAIT_S = 600  # how long a reload that outlived --timeout, or one going back, may take


class RolloutError(Exception):
    """A step failed; the message says which daemon and why."""


@dataclass
class Daemon:
    """One daemon of the fleet: a name to print and the argv prefix that runs inferctl against it."""

    name: str
    inferctl: list[str]
    was_live: str = ""

    def run(self, *argv: str, timeout: float) -> str:
        """Run one inferctl command; its output, or RolloutError with what it said."""
        try:
            done = subprocess.run([*self.inferctl, *argv], check=False, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RolloutError(f"{self.name}: inferctl {argv[0]} took more than {timeout:g} s") from None
        except OSError as exc:
            raise RolloutError(f"{self.name}: cannot run {self.inferctl[0]}: {exc.strerror}") from None
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            raise RolloutError(f"{self.name}: {said[-1] if said else f'inferctl exited with {done.returncode}'}")
        return done.stdout.strip()

    def live_version(self, model: str, settled: bool = False) -> str:
        """The version of `model` this daemon serves now; with `settled`, once no reload of it runs
        (waiting at most SETTLE_WAIT_S)."""
        give_up = time.monotonic() + SETTLE_WAIT_S
        while True:
            status = json.loads(self.run("status", "--json", timeout=STATUS_TIMEOUT_S))
            if model not in status["models"]:
                raise RolloutError(f"{self.name}: serves no model named {model!r}")
            entry = status["models"][model]
            if not settled or entry["reloading_to"] is None or time.monotonic() > give_up:
                return entry["live_version"]
            time.sleep(0.5)

    def reload(self, model: str, version: str, timeout: float) -> str:
        """Make `version` live; what inferctl reported."""
        return self.run("reload", "--model", model, "--version", version, timeout=timeout)


def kubernetes_daemons(namespace: str, selector: str, container: str, kubectl: str) -> list[Daemon]:
    """The running pods that `selector` picks, in name order, each reached through `kubectl exec`."""
    listing = subprocess.run([kubectl, "get", "pods", "-n", namespace, "-l", selector, "-o", "json"],
                             check=False, capture_output=True, text=True)
    if listing.returncode != 0:
        raise RolloutError(f"kubectl get pods failed: {listing.stderr.strip()}")
    pods = sorted(item["metadata"]["name"]
                  for item in json.loads(listing.stdout)["items"] if item["status"].get("phase") == "Running")
    if not pods:
        raise RolloutError(f"no running pod in namespace {namespace} matches {selector}")
    # No labels here: inferd-fleet labels each pod with the versions it serves.
    return [Daemon(f"pod/{pod}", [kubectl, "exec", "-n", namespace, pod, "-c", container, "--", "inferctl"])
            for pod in pods]


def roll_out(daemons: list[Daemon], model: str, version: str, timeout: float) -> None:
    """Switch every daemon to `version`, or leave every one on what it served before."""
    for daemon in daemons:  # all reachable and serving the model before anything changes
        daemon.was_live = daemon.live_version(model)
    switched: list[Daemon] = []
    for daemon in daemons:
        if daemon.was_live == version:
            print(f"{daemon.name}: {model} {version} is live already", flush=True)
            continue
        try:
            print(f"{daemon.name}: {daemon.reload(model, version, timeout)}", flush=True)
        except RolloutError as exc:
            print(f"rollout stopped: {exc}", file=sys.stderr, flush=True)
            if _switched_anyway(daemon, model):  # e.g. the reload outlived --timeout
                switched.append(daemon)
            roll_back(switched, model, timeout)
            raise RolloutError(f"{model} {version} was refused by {daemon.name}; "
                               f"{len(switched)} daemon(s) rolled back") from None
        switched.append(daemon)


def _switched_anyway(daemon: Daemon, model: str) -> bool:
    """Whether a daemon whose reload failed serves something else than before all the same
    (a reload that outlived --timeout goes on in the daemon: wait for it to end)."""
    try:
        return daemon.live_version(model, settled=True) != daemon.was_live
    except RolloutError:
        return False  # unreachable now: nothing this script can undo there


def roll_back(switched: list[Daemon], model: str, timeout: float) -> None:
    """Return each switched daemon, newest first, to the version it served before the rollout.

    The way back is never cut short by a --timeout tuned for the way there.
    """
    failed = []
    for daemon in reversed(switched):
        try:
            said = daemon.reload(model, daemon.was_live, max(timeout, SETTLE_WAIT_S))
            print(f"{daemon.name}: back: {said}", file=sys.stderr, flush=True)
        except RolloutError as exc:
            failed.append(str(exc))
    if failed:
        raise RolloutError("rolling back failed too: " + "; ".join(failed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model to roll out")
    parser.add_argument("--version", required=True, help="the version folder to make live")
    fleet = parser.add_mutually_exclusive_group(required=True)
    fleet.add_argument("--control", action="append", help="a daemon's control endpoint (repeat per daemon)")
    fleet.add_argument("--kubernetes", action="store_true", help="the pods of a Deployment, through kubectl exec")
    parser.add_argument("--namespace", default="inferd")
    parser.add_argument("--selector", default="app.kubernetes.io/name=inferd", help="pod label selector")
    parser.add_argument("--container", default="inferd")
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--inferctl", default="inferctl", help="inferctl to run with --control")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one daemon may take to switch")
    args = parser.parse_args(argv)
    try:
        if args.kubernetes:
            daemons = kubernetes_daemons(args.namespace, args.selector, args.container, args.kubectl)
        else:
            daemons = [Daemon(endpoint, [args.inferctl, "--control", endpoint]) for endpoint in args.control]
        roll_out(daemons, args.model, args.version, args.timeout)
    except RolloutError as exc:
        print(f"rollout failed: {exc}", file=sys.stderr)
        return 1
    print(f"{args.model} {args.version} is live on all {len(daemons)} daemon(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
