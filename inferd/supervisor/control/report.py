"""The daemon's reports: `inferctl stats`, one JSON object built from its measurements, and the one
line systemd shows.

The stats' schema is documented in docs/operations/watching.md ("inferctl stats --json"); the
Prometheus endpoint reads the same measurements (see metrics.py).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from inferd.supervisor.processes.workers import StepHandle, WorkerState
from inferd.supervisor.shared.candidates import Candidate, Mode
from inferd.supervisor.shared.stats import LoadSeries, Series

if TYPE_CHECKING:
    from inferd.supervisor.control.view import DaemonView
    from inferd.supervisor.processes.workers import WorkerHandle


def _latency(series: Series) -> dict[str, dict[str, float]]:
    return {"total": series.total.summary_ms(), "queue": series.queue.summary_ms(),
            "compute": series.compute.summary_ms()}


def _series_report(since_start: Series, minute: Series, ten: Series, minute_s: float, ten_s: float) -> dict[str, Any]:
    batches = sum(since_start.batch_sizes.values())
    return {
        "requests": dict(since_start.replies),
        "samples": since_start.samples,
        "latency_ms": _latency(minute),
        "latency_ms_since_start": _latency(since_start),
        "throughput": {
            "samples_per_s_10s": round(ten.samples / ten_s, 1),
            "samples_per_s_60s": round(minute.samples / minute_s, 1),
            "requests_per_s_10s": round(sum(ten.replies.values()) / ten_s, 1),
            "requests_per_s_60s": round(sum(minute.replies.values()) / minute_s, 1),
        },
        "batch_size": {
            "mean": round(sum(size * n for size, n in since_start.batch_sizes.items()) / batches, 2) if batches else 0,
            "distribution": {str(size): n for size, n in sorted(since_start.batch_sizes.items())},
        },
        "queue_depth_peak_60s": minute.queue_peak,
        "goodput": {
            "requests_per_s_10s": round(ten.good / ten_s, 1),
            "requests_per_s_60s": round(minute.good / minute_s, 1),
            "requests": since_start.good,
        },
    }


def admission_estimate_s(daemon: DaemonView, model: str, now: float) -> float | None:
    """When a one-sample request at the default priority, arriving now, would finish at the soonest
    (seconds; None while the model's compute time is not known): what admission compares with its deadline."""
    config = daemon.config
    return daemon.forecast.finish_in(model, config.models[model].max_batch_size, config.queue.default_level,
                                     1, now)


def priority_report(daemon: DaemonView, model: str) -> dict[str, Any]:
    """Replies and ok latency since start of each priority level of `model` that saw requests."""
    return {
        str(level): {"requests": dict(series.replies), "latency_ms": series.total.summary_ms()}
        for (name, level), series in sorted(daemon.stats.levels.items())
        if name == model
    }


def candidate_status(candidate: Candidate | None) -> dict[str, Any] | None:
    """What `status` and `stats` both say of a model's trial (None without one)."""
    if candidate is None:
        return None
    now = time.time()
    return {
        "version": candidate.version,
        "mode": str(candidate.mode),
        "weight": candidate.weight,
        "guarded": candidate.guarded,
        "running_s": round(now - candidate.started, 3),
        "promote_in_s": None if candidate.promote_at is None else round(max(0.0, candidate.promote_at - now), 3),
    }


def candidate_report(daemon: DaemonView, model: str, now: float) -> dict[str, Any] | None:
    """`model`'s trial: as status says, with the share of samples routed so far and the guard's judgement."""
    candidate = daemon.candidates.get(model)
    if candidate is None:
        return None
    report = candidate_status(candidate)
    assert report is not None
    share = daemon.dispatcher.split_share(model)
    report["routed_share"] = None if share is None else round(share, 4)
    if candidate.mode == Mode.CANARY:
        judgement = daemon.canaries.judgement(model, now)
        report["guard"] = {"verdict": judgement.verdict, "reason": judgement.reason,
                           "window_s": daemon.canaries.guard(model).window_s,
                           "candidate": judgement.candidate, "live": judgement.live}
    return report


def shadow_report(daemon: DaemonView, model: str) -> dict[str, Any]:
    """Per candidate version of `model` that was shadowed: how its outputs and compute time compared."""
    report = {}
    for (name, version), series in sorted(daemon.stats.shadow.items()):
        if name != model:
            continue
        report[version] = {
            "chosen": series.chosen,
            "compared": series.compared,
            "allclose_share": round(series.allclose / series.compared, 4) if series.compared else None,
            "mismatched_shapes": series.mismatched,
            "max_abs_difference": series.max_abs,
            "max_rel_difference": series.max_rel,
            "failed": series.failed,
            "dropped": dict(series.dropped),
            "compute_ms": {"live": series.live_compute.summary_ms(), "shadow": series.shadow_compute.summary_ms()},
        }
    return report


NEVER_LOADED = LoadSeries()  # read, never written: what a model loaded on no worker yet reports


def loading_report(daemon: DaemonView, model: str) -> dict[str, Any]:
    """How `model` loads: always, or on demand with its loads, unloads and the requests that waited."""
    series = daemon.stats.loading.get(model, NEVER_LOADED)
    return {"load": daemon.config.models[model].load, "loads": series.loads, "failed_loads": series.failed,
            "unloads": series.unloads, "load_ms": series.load_time.summary_ms(),
            "waited_for_load_ms": series.waited.summary_ms()}


def worker_summary(w: WorkerHandle) -> dict[str, Any]:
    """What `status` and `stats` both say of a worker (or a Python model's step: its model and number in the
    model's pool): who it is, its state, its counters."""
    return {
        "worker": w.index,
        "kind": w.kind,
        "name": w.name,
        **({"model": w.model, "number": w.number} if isinstance(w, StepHandle) else {}),
        "pid": w.pid,
        "device": w.device,
        "state": w.state,
        "generation": w.generation,
        "restarts": w.restarts,
        "executors_busy": sum(1 for e in w.executors if e.inflight),
        "batches_in_flight": w.inflight,
        "requests_in_flight": w.requests_in_flight,
        "batches": w.batches,
        "ping_ms": None if w.ping_ms is None else round(w.ping_ms, 3),
        "models": sorted({model for model, _ in w.loaded}),
        "model_memory_bytes": w.model_memory,
    }


def worker_report(daemon: DaemonView) -> list[dict[str, Any]]:
    """Each worker: process, state, counters, memory, and on a GPU what NVML and torch say."""
    report = []
    daemon.probes.forget({w.pid for w in daemon.workers.workers if w.pid})
    for w in daemon.workers.workers:
        entry: dict[str, Any] = {
            **worker_summary(w),
            **daemon.probes.process(w.pid),
            "memory_growth_bytes": w.memory_growth,
            "leak_warning": w.leak_warned,
        }
        if w.device.startswith("cuda"):
            entry.update(daemon.probes.gpu(w.device))
            entry["torch_allocated_bytes"] = w.memory
            entry["torch_reserved_bytes"] = w.reserved
            entry["fragmentation"] = round((w.reserved - w.memory) / w.reserved, 4) if w.reserved else 0.0
        report.append(entry)
    return report


def gateway_replies(daemon: DaemonView) -> dict[str, list[tuple[str, str, int]]]:
    """Per model, the replies that went through a gateway since start: (protocol, status, count)."""
    found: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for (model, protocol, status), n in daemon.stats.by_protocol.items():
        if model is not None:  # a request refused before its model was known
            found[model].append((protocol, status, n))
    return found


def requests_by_protocol(replies: Counter[str],
                         through_gateways: list[tuple[str, str, int]]) -> dict[str, dict[str, int]]:
    """A model's replies since start (`replies`, by status) by protocol: those of `through_gateways`
    (gateway_replies), and the rest (ZeroMQ, and inferctl infer)."""
    result: dict[str, dict[str, int]] = {"zmq": dict(replies)}
    for protocol, status, n in through_gateways:
        result.setdefault(protocol, {})[status] = n
        result["zmq"][status] = result["zmq"].get(status, 0) - n
    result["zmq"] = {status: n for status, n in result["zmq"].items() if n}
    return result


def connections_report(daemon: DaemonView) -> dict[str, Any]:
    """ZeroMQ client connections open now and those turned away or not accepted, by reason; the limit on
    open files they count against, how many of them the clients may hold (their connections and regions),
    and how many they hold."""
    connections = daemon.connections
    return {"zmq": {"open": connections.open, "refused": dict(connections.refused)},
            "open_files_limit": connections.budget.limit, "descriptors_for_clients": connections.budget.for_clients,
            "descriptors_held_by_clients": connections.held}


def systemd_status(daemon: DaemonView) -> tuple[str, int]:
    """The one-line summary systemd shows, and the replies so far (for the rate)."""
    workers = daemon.workers.workers
    ready = sum(w.state == WorkerState.READY for w in workers)
    live = ", ".join(f"{n} {v}" + (f" ({daemon.candidates[n].describe()})" if n in daemon.candidates else "")
                     for n, v in daemon.live.items())
    return f"{daemon.state}; {ready}/{len(workers)} workers ready; {live}", sum(daemon.stats.replies.values())


def pipeline_report(daemon: DaemonView) -> dict[str, Any]:
    """Each pipeline since start: its replies by status, the latency of those `ok`, its requests under way, and per
    step (in its order) the step's model, its requests' wait in the model's queue and their batches' compute time:
    the step whose wait grows is the bottleneck."""
    report = {}
    pipelines = daemon.pipelines
    for name, graph in sorted(pipelines.graphs.items()):
        series = daemon.stats.pipeline(name)
        report[name] = {
            "requests": dict(series.replies), "latency_ms": series.total.summary_ms(),
            "in_flight": pipelines.in_flight[name], "max_in_flight": graph.config.max_in_flight,
            "steps": {step.title: {"model": step.model, "wait_ms": series.step(step.title).wait.summary_ms(),
                                   "compute_ms": series.step(step.title).compute.summary_ms()}
                      for step in graph.steps},
        }
    return report


def stats_report(daemon: DaemonView) -> dict[str, Any]:
    """The whole `stats` object."""
    now = time.monotonic()
    minute, minute_s = daemon.stats.recent(now, 60)
    ten, ten_s = daemon.stats.recent(now, 10)
    models: dict[str, Any] = {}
    # Each model's series and shapes found in one pass, and one report for every model not yet asked
    # for: a daemon of a thousand models (most idle) answers in milliseconds, not in a second.
    served: dict[str, list[tuple[str, Series]]] = defaultdict(list)
    for (model, version), since_start in sorted(daemon.stats.since_start.items()):
        served[model].append((version, since_start))
    shapes: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (model, shape), (batches, real, padding) in sorted(daemon.stats.shapes.items()):
        shapes[model][shape] = {"batches": batches, "elements": real, "padding_elements": padding,
                                "padding_share": round(padding / real, 4) if real else 0.0}
    unused = _series_report(Series(), Series(), Series(), minute_s, ten_s)
    through_gateways = gateway_replies(daemon)
    for name, live in daemon.live.items():
        versions, report, replies = {}, unused, Counter[str]()
        if name in served:
            totals = [Series(), Series(), Series()]
            for version, since_start in served[name]:
                parts = (since_start, minute.get((name, version), Series()), ten.get((name, version), Series()))
                versions[version] = _series_report(parts[0], parts[1], parts[2], minute_s, ten_s)
                for total, part in zip(totals, parts):
                    total.merge(part)
            report, replies = _series_report(totals[0], totals[1], totals[2], minute_s, ten_s), totals[0].replies
        models[name] = {
            "live_version": live,
            **report,
            "requests_by_protocol": requests_by_protocol(replies, through_gateways.get(name, [])),
            "queue_depth": daemon.queue.depth(name),
            "priorities": priority_report(daemon, name),
            "admission": {
                "estimate_ms": None if (estimate := admission_estimate_s(daemon, name, now)) is None
                else round(estimate * 1000, 3),
                "refused_as_late": daemon.stats.deadline_refusals[name],
            },
            "versions": versions,
            "shapes": shapes.get(name, {}),
            "candidate": candidate_report(daemon, name, now),
            "shadow": shadow_report(daemon, name),
            "loading": loading_report(daemon, name),
        }
    return {
        "uptime_s": round(now - daemon.started, 3),
        "state": daemon.state,
        "models": models,
        "pipelines": pipeline_report(daemon),
        "workers": worker_report(daemon),
        "undelivered_replies": daemon.stats.undelivered,
        "regions": daemon.regions.status(),
        "connections": connections_report(daemon),
    }
