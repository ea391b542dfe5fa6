"""`inferd-fleet`: the controller's command line."""

from __future__ import annotations

import logging
import signal
import sys

import click

from inferd.cli.common import CliError, Duration, Finite, run_command
from inferd.fleet.decisions import Policy
from inferd.ipc import addresses
from inferd.system.logs import setup_logging

log = logging.getLogger("inferd.fleet")


def _host_port(value: str) -> tuple[str, int]:
    host, port = addresses.split(value)
    if not host or not port.isdigit():
        raise CliError(f"--metrics {value!r} is not HOST:PORT")
    return host, int(port)


@click.command()
@click.option("--namespace", default="inferd", show_default=True, help="Namespace of the inference pods.")
@click.option("--selector", default="app.kubernetes.io/name=inferd", show_default=True,
              help="Label selector of the inference pods.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, exists=True),
              help="Reach the API through this kubeconfig (default: the pod's service account).")
@click.option("--interval", type=Duration(), default="30s", show_default=True,
              help="How often every pod's metrics are read and the rules applied.")
@click.option("--fragmentation-threshold", type=Finite(0, 1, min_open=True), default=0.25,
              show_default=True, help="A node's share of reserved GPU memory unused above which it counts as "
              "fragmented.")
@click.option("--fragmentation-for", "hold", type=Duration(), default="5m", show_default=True,
              help="How long a node stays fragmented before its pods are asked to trim.")
@click.option("--fragmentation-min-stranded", "min_stranded", type=Finite(0), default=1.0,
              show_default=True, help="GiB a node must strand before it counts as fragmented: a restart costs a "
              "cold start, which a few MiB do not pay for.")
@click.option("--trim-grace", type=Duration(), default="2m", show_default=True,
              help="How long after the trim a node may stay fragmented before a pod on it is evicted.")
@click.option("--metrics", "metrics_at", default="0.0.0.0:9466", show_default=True,
              help="HOST:PORT where the controller's own metrics are served.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def fleet(namespace: str, selector: str, kubeconfig: str | None, interval: float, fragmentation_threshold: float,
          hold: float, min_stranded: float, trim_grace: float, metrics_at: str, log_level: str) -> None:
    """Keep inference pods' version labels true and restart pods stranding GPU memory (docs/scaling/kubernetes.md)."""
    from inferd.fleet.cluster import Cluster
    from inferd.fleet.controller import Controller
    from inferd.fleet.metrics import FleetMetrics

    setup_logging("inferd-fleet", log_level)
    host, port = _host_port(metrics_at)
    metrics = FleetMetrics()
    try:
        cluster = Cluster(namespace, selector, kubeconfig)
        metrics.serve(host, port)
    except OSError as exc:
        raise CliError(f"cannot serve metrics on {metrics_at}: {exc.strerror}") from None
    except Exception as exc:  # noqa: BLE001 - the client's config errors are of many kinds; one sentence each
        raise CliError(f"cannot reach the Kubernetes API: {exc}") from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    policy = Policy(fragmentation_threshold, hold, trim_grace, int(min_stranded * 2**30))
    log.info("watching pods %s in %s every %g s; metrics on %s", selector, namespace, interval, metrics_at)
    Controller(cluster, policy, metrics, interval).run()


def main() -> None:
    """Entry point of `inferd-fleet`."""
    run_command(fleet, "inferd-fleet")
