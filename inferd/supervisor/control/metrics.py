"""The Prometheus endpoint at `server.metrics`.

metrics_http.py serves HTTP from its own threads. At each scrape the
collector asks the supervisor's loop (call_soon_threadsafe) to turn the
measurements into metric families, and waits for them: the numbers are read
on the one thread that writes them, and worker figures arrive in the
supervisor's own messages, so no multiprocess registry (and none of its files)
is involved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from inferd.ipc import addresses
from inferd.supervisor.control.metrics_http import MetricsHttpServer
from inferd.supervisor.control.report import admission_estimate_s, gateway_replies, requests_by_protocol, worker_report
from inferd.supervisor.shared.state import StartupError
from inferd.supervisor.shared.stats import BATCH_BOUNDS, PROMETHEUS_BOUNDS, Histogram, Series

if TYPE_CHECKING:
    from inferd.supervisor.control.view import DaemonView

log = logging.getLogger("inferd.metrics")

SCRAPE_WAIT_S = 5.0


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative(PROMETHEUS_BOUNDS)]
    family.add_metric(labels, buckets, histogram.sum)


def build_families(daemon: DaemonView) -> list[Metric]:
    """Every metric, from the daemon's state now (call on the loop thread)."""
    requests = CounterMetricFamily("inferd_requests", "Requests answered, by status.",
                                   labels=["model", "version", "status"])
    samples = CounterMetricFamily("inferd_samples", "Samples answered ok.", labels=["model", "version"])
    durations = {
        part: HistogramMetricFamily(name, doc, labels=["model", "version"])
        for part, name, doc in (
            ("total", "inferd_request_duration_seconds", "Time from a request's arrival to its reply (ok replies)."),
            ("queue", "inferd_request_queue_seconds", "Time a request waited before its batch was sent."),
            ("compute", "inferd_request_compute_seconds", "Time the worker spent on the request's batch."),
        )
    }
    batch_size = HistogramMetricFamily("inferd_batch_size", "Samples per batch.", labels=["model", "version"])
    queue_depth = GaugeMetricFamily("inferd_queue_depth", "Requests waiting.", labels=["model"])
    live = GaugeMetricFamily("inferd_model_live", "1 for the version each model serves.", labels=["model", "version"])
    per_model: dict[str, Series] = {name: Series() for name in daemon.live}
    for (model, version), series in sorted(daemon.stats.since_start.items()):
        for status, count in sorted(series.replies.items()):
            requests.add_metric([model, version, status], count)
        samples.add_metric([model, version], series.samples)
        for part, family in durations.items():
            _histogram(family, [model, version], getattr(series, part))
        cumulative, running = [], 0
        for bound in BATCH_BOUNDS:
            running += sum(n for size, n in series.batch_sizes.items() if (bound // 2) < size <= bound)
            cumulative.append((floatToGoString(bound), running))
        cumulative.append(("+Inf", sum(series.batch_sizes.values())))
        batch_size.add_metric([model, version], cumulative, sum(size * n for size, n in series.batch_sizes.items()))
        if model in per_model:
            per_model[model].merge(series)
    for model in per_model:
        queue_depth.add_metric([model], daemon.queue.depth(model))
        live.add_metric([model, daemon.live[model]], 1)
    families: list[Metric] = [requests, samples, *durations.values(), batch_size, queue_depth, live]
    families += _worker_families(daemon)
    families += _scheduling_families(daemon, per_model)
    families += _trial_families(daemon)
    by_protocol = CounterMetricFamily("inferd_requests_by_protocol", "Requests answered, by protocol and status.",
                                      labels=["model", "protocol", "status"])
    through_gateways = gateway_replies(daemon)
    for model in daemon.live:
        for protocol, statuses in requests_by_protocol(per_model[model].replies,
                                                       through_gateways.get(model, [])).items():
            for status, count in sorted(statuses.items()):
                by_protocol.add_metric([model, protocol, status], count)
    families.append(by_protocol)
    families += _shape_families(daemon)
    families += _loading_families(daemon)
    undelivered = CounterMetricFamily("inferd_replies_undelivered", "Replies whose client had gone or stopped reading.")
    undelivered.add_metric([], daemon.stats.undelivered)
    families.append(undelivered)
    families += _connection_families(daemon)
    families += _pipeline_families(daemon)
    return families


def _pipeline_families(daemon: DaemonView) -> list[Metric]:
    """Each pipeline's requests and latency, and per step its requests' queue wait and batches' compute time."""
    requests = CounterMetricFamily("inferd_pipeline_requests", "Requests of a pipeline answered, by status.",
                                   labels=["pipeline", "status"])
    latency = HistogramMetricFamily("inferd_pipeline_latency_seconds", "Time from a pipeline request's arrival to "
                                    "its reply (ok replies).", labels=["pipeline"])
    steps = HistogramMetricFamily("inferd_pipeline_step_seconds", "Per step of a pipeline request: its wait in the "
                                  "step's model's queue (phase wait), its batch's compute time (phase compute).",
                                  labels=["pipeline", "step", "phase"])
    for name, graph in sorted(daemon.pipelines.graphs.items()):
        series = daemon.stats.pipeline(name)
        for status, count in sorted(series.replies.items()):
            requests.add_metric([name, status], count)
        _histogram(latency, [name], series.total)
        for step in graph.steps:
            _histogram(steps, [name, step.title, "wait"], series.step(step.title).wait)
            _histogram(steps, [name, step.title, "compute"], series.step(step.title).compute)
    return [requests, latency, steps]


def _connection_families(daemon: DaemonView) -> list[Metric]:
    """Client connections open, and those that could not be accepted."""
    connections = daemon.connections
    open_ = GaugeMetricFamily("inferd_connections", "Client connections open, by protocol.", labels=["protocol"])
    open_.add_metric(["zmq"], connections.open)
    refused = CounterMetricFamily("inferd_connections_refused", "Client connections that could not be accepted, by "
                                  "protocol and reason (descriptors: the open-files limit), counted as they are "
                                  "logged: once a minute at most while it goes on.", labels=["protocol", "reason"])
    for reason, count in sorted(connections.refused.items()):
        refused.add_metric(["zmq", reason], count)
    return [open_, refused]


def _loading_families(daemon: DaemonView) -> list[Metric]:
    """The on-demand models' loads and unloads, and what the models of each worker hold."""
    loads = CounterMetricFamily("inferd_model_loads", "Loads of an on-demand model, by outcome.",
                                labels=["model", "outcome"])
    unloads = CounterMetricFamily("inferd_model_unloads", "Unloads of an on-demand model.", labels=["model"])
    load_time = HistogramMetricFamily("inferd_model_load_seconds", "Time from asking a worker to load an on-demand "
                                      "model to its answer.", labels=["model"])
    waited = HistogramMetricFamily("inferd_load_wait_seconds", "How long each request that waited for its "
                                   "on-demand model to load had waited.", labels=["model"])
    for model, series in sorted(daemon.stats.loading.items()):
        loads.add_metric([model, "loaded"], series.loads)
        loads.add_metric([model, "failed"], series.failed)
        unloads.add_metric([model], series.unloads)
        _histogram(load_time, [model], series.load_time)
        _histogram(waited, [model], series.waited)
    memory = GaugeMetricFamily("inferd_worker_model_memory_bytes", "What the models loaded on a worker hold, as "
                               "each measured after warm-up.", labels=["worker"])
    held = GaugeMetricFamily("inferd_worker_model_loaded", "1 for each model a worker has loaded.",
                             labels=["worker", "model"])
    for worker in daemon.workers.workers:
        memory.add_metric([str(worker.index)], worker.model_memory)
        for model in sorted({model for model, _ in worker.loaded}):
            held.add_metric([str(worker.index), model], 1)
    return [loads, unloads, load_time, waited, memory, held]


def _shape_families(daemon: DaemonView) -> list[Metric]:
    """Batches of the models with inputs of any size, by shape, and the padding they computed."""
    batches = CounterMetricFamily("inferd_batches_by_shape", "Batches of a model with inputs of any size, by the "
                                  "per-sample shape of their first input.", labels=["model", "shape"])
    real = CounterMetricFamily("inferd_input_elements", "Input elements the requests brought, by batch shape.",
                               labels=["model", "shape"])
    padding = CounterMetricFamily("inferd_padding_elements", "Input elements of padding the model computed on, by "
                                  "batch shape (over inferd_input_elements: the padding share).",
                                  labels=["model", "shape"])
    for (model, shape), counts in sorted(daemon.stats.shapes.items()):
        for family, count in zip((batches, real, padding), counts):
            family.add_metric([model, shape], count)
    return [batches, real, padding]


def _scheduling_families(daemon: DaemonView, per_model: dict[str, Series]) -> list[Metric]:
    """Priority levels, goodput and deadline-aware admission."""
    by_level = CounterMetricFamily("inferd_requests_by_priority", "Requests answered, by priority level and status.",
                                   labels=["model", "priority", "status"])
    level_durations = HistogramMetricFamily("inferd_request_duration_by_priority_seconds",
                                            "Time from a request's arrival to its ok reply, by priority level.",
                                            labels=["model", "priority"])
    for (model, level), level_series in sorted(daemon.stats.levels.items()):
        for status, count in sorted(level_series.replies.items()):
            by_level.add_metric([model, str(level), status], count)
        _histogram(level_durations, [model, str(level)], level_series.total)
    good = CounterMetricFamily("inferd_goodput_requests", "Requests answered ok within their deadline.",
                               labels=["model"])
    good_rate = GaugeMetricFamily("inferd_goodput_requests_per_second",
                                  "Requests answered ok within their deadline per second, over the last 10 s.",
                                  labels=["model"])
    estimate = GaugeMetricFamily("inferd_admission_estimate_seconds",
                                 "When a new request at the default priority would finish at the soonest "
                                 "(absent until the model's compute time is known).", labels=["model"])
    refused = CounterMetricFamily("inferd_deadline_refusals", "Requests refused at once as sure to miss their "
                                  "deadline.", labels=["model"])
    now = time.monotonic()
    ten, ten_s = daemon.stats.recent(now, 10)
    for model, series in per_model.items():
        good.add_metric([model], series.good)
        good_rate.add_metric([model], sum(s.good for (name, _), s in ten.items() if name == model) / ten_s)
        seconds = admission_estimate_s(daemon, model, now)
        if seconds is not None:
            estimate.add_metric([model], seconds)
        refused.add_metric([model], daemon.stats.deadline_refusals[model])
    return [by_level, level_durations, good, good_rate, estimate, refused]


def _trial_families(daemon: DaemonView) -> list[Metric]:
    """Canaries and shadows: the running trials, how they ended, and how shadowed outputs compared."""
    weight = GaugeMetricFamily("inferd_candidate_weight_ratio", "Share of the model's samples its candidate version "
                               "takes (canary) or recomputes (shadow).", labels=["model", "version", "mode"])
    for model, candidate in sorted(daemon.candidates.items()):
        weight.add_metric([model, candidate.version, str(candidate.mode)], candidate.weight / 100)
    outcomes = CounterMetricFamily("inferd_trials_ended", "Trials of a candidate version that ended, by how.",
                                   labels=["model", "outcome"])
    for (model, outcome), count in sorted(daemon.canaries.outcomes.items()):
        outcomes.add_metric([model, outcome], count)
    shadow_requests = CounterMetricFamily("inferd_shadow_requests", "Requests picked to be computed again by a "
                                          "shadow version, by what came of it.", labels=["model", "version", "outcome"])
    allclose = GaugeMetricFamily("inferd_shadow_allclose_ratio", "Share of compared requests whose shadow outputs "
                                 "were allclose to the live ones.", labels=["model", "version"])
    max_abs = GaugeMetricFamily("inferd_shadow_max_abs_difference", "Largest absolute difference between a shadow "
                                "output and the live one.", labels=["model", "version"])
    max_rel = GaugeMetricFamily("inferd_shadow_max_rel_difference", "Largest relative difference between a shadow "
                                "output and the live one.", labels=["model", "version"])
    compute = HistogramMetricFamily("inferd_shadow_compute_seconds", "Compute time of the batches both versions "
                                    "computed, by side (live, shadow).", labels=["model", "version", "side"])
    for (model, version), series in sorted(daemon.stats.shadow.items()):
        labels = [model, version]
        shadow_requests.add_metric([*labels, "compared"], series.compared)
        shadow_requests.add_metric([*labels, "failed"], series.failed)
        shadow_requests.add_metric([*labels, "dropped"], sum(series.dropped.values()))
        if series.compared:
            allclose.add_metric(labels, series.allclose / series.compared)
        max_abs.add_metric(labels, series.max_abs)
        max_rel.add_metric(labels, series.max_rel)
        _histogram(compute, [*labels, "live"], series.live_compute)
        _histogram(compute, [*labels, "shadow"], series.shadow_compute)
    return [weight, outcomes, shadow_requests, allclose, max_abs, max_rel, compute]


def _worker_families(daemon: DaemonView) -> list[Metric]:
    restarts = CounterMetricFamily("inferd_worker_restarts", "Times a worker process was replaced.", labels=["worker"])
    up = GaugeMetricFamily("inferd_worker_ready", "1 while the worker is ready to run batches.",
                           labels=["worker", "device"])
    rss = GaugeMetricFamily("inferd_worker_resident_memory_bytes", "Host memory of the worker process.",
                            labels=["worker"])
    growth = GaugeMetricFamily("inferd_memory_growth_bytes",
                               "Growth of the worker's memory over its level after warm-up (the leak watch).",
                               labels=["worker"])
    gpu_used = GaugeMetricFamily("inferd_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["device"])
    gpu_total = GaugeMetricFamily("inferd_gpu_memory_total_bytes", "GPU memory in all (NVML).", labels=["device"])
    gpu_util = GaugeMetricFamily("inferd_gpu_utilization_ratio", "GPU busy time over the last sample (NVML).",
                                 labels=["device"])
    fragmentation = GaugeMetricFamily("inferd_gpu_memory_fragmentation_ratio",
                                      "Reserved but unallocated GPU memory over reserved memory.", labels=["worker"])
    reserved = GaugeMetricFamily("inferd_gpu_memory_reserved_bytes", "GPU memory the worker's allocator reserves.",
                                 labels=["worker"])
    for entry in worker_report(daemon):
        worker = str(entry["worker"])
        restarts.add_metric([worker], entry["restarts"])
        up.add_metric([worker, entry["device"]], 1 if entry["state"] == "ready" else 0)
        growth.add_metric([worker], entry["memory_growth_bytes"])
        if "rss_bytes" in entry:
            rss.add_metric([worker], entry["rss_bytes"])
        if "gpu_memory_used_bytes" in entry:
            gpu_used.add_metric([entry["device"]], entry["gpu_memory_used_bytes"])
            gpu_total.add_metric([entry["device"]], entry["gpu_memory_total_bytes"])
            gpu_util.add_metric([entry["device"]], entry["gpu_utilization"])
        if "fragmentation" in entry:
            fragmentation.add_metric([worker], entry["fragmentation"])
            reserved.add_metric([worker], entry["torch_reserved_bytes"])
    return [restarts, up, rss, growth, gpu_used, gpu_total, gpu_util, fragmentation, reserved]


class _LoopCollector:
    """A collector that has the supervisor's loop build the families and waits for them."""

    def __init__(self, daemon: DaemonView, call_soon_threadsafe: Callable[[Callable[[], None]], None]) -> None:
        self._daemon = daemon
        self._call_soon_threadsafe = call_soon_threadsafe

    def collect(self) -> Iterator[Metric]:
        done = threading.Event()
        result: list[Metric] = []

        def build() -> None:
            try:
                result.extend(build_families(self._daemon))
            finally:
                done.set()

        self._call_soon_threadsafe(build)
        if not done.wait(SCRAPE_WAIT_S):
            log.warning("a scrape waited %g s for the supervisor's loop; answering without numbers", SCRAPE_WAIT_S)
        yield from result


class MetricsServer:
    """The HTTP endpoint Prometheus scrapes (none when server.metrics is "")."""

    def __init__(self, daemon: DaemonView) -> None:
        self._daemon = daemon
        self._server: MetricsHttpServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, address: str) -> None:
        """Serve at `address` (HOST:PORT) from threads of its own."""
        if not address:
            return
        host, port = addresses.split(address)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_LoopCollector(self._daemon, self._daemon.call_soon_threadsafe))
        try:
            self._server = MetricsHttpServer(host, int(port), registry)
            self._thread = self._server.start()
        except OSError as exc:
            raise StartupError(f"cannot serve metrics at {address} (server.metrics): {exc.strerror}") from None
        log.info("metrics at http://%s/metrics", address)

    def close(self) -> None:
        """Stop serving."""
        if self._server is None or self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None
