"""Fixed-memory histograms, time windows, and the probes (NVML faked: this machine has none)."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from inferd.supervisor.processes.devices import resolve_devices
from inferd.supervisor.processes.probes import Probes
from inferd.supervisor.shared.stats import BOUNDS, PROMETHEUS_BOUNDS, Histogram, Stats


def test_quantiles_are_within_a_bucket_of_the_truth():
    rng = np.random.default_rng(0)
    values = rng.lognormal(mean=np.log(0.003), sigma=0.8, size=20_000)
    histogram = Histogram()
    for v in values:
        histogram.add(float(v))
    for q in (0.5, 0.9, 0.99):
        truth = float(np.quantile(values, q))
        assert abs(histogram.quantile(q) - truth) / truth < 0.25, q
    assert histogram.max == pytest.approx(values.max())
    assert histogram.count == len(values) and histogram.sum == pytest.approx(values.sum())


def test_counting_a_batch_at_once_equals_counting_each_value():
    values = [0.0004, 0.002, 0.002, 0.3, 500.0, 0.00001]
    one_by_one, at_once, repeated = Histogram(), Histogram(), Histogram()
    for v in values:
        one_by_one.add(v)
        repeated.add(0.002)
    at_once.add_all(values)
    at_once.add_all([])
    repeated_at_once = Histogram()
    repeated_at_once.add(0.002, len(values))
    for a, b in ((one_by_one, at_once), (repeated, repeated_at_once)):
        assert (a.counts, a.count, a.max) == (b.counts, b.count, b.max) and a.sum == pytest.approx(b.sum)


def test_an_empty_histogram_says_zero():
    assert Histogram().quantile(0.99) == 0.0 and Histogram().summary_ms()["max"] == 0.0


def test_cumulative_buckets_for_prometheus_are_monotonic_and_end_with_the_count():
    histogram = Histogram()
    for v in (0.0004, 0.002, 0.002, 0.3, 500.0):
        histogram.add(v)
    buckets = histogram.cumulative(PROMETHEUS_BOUNDS)
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and buckets[-1] == (float("inf"), 5)
    assert dict(buckets)[0.0005] == 1 and dict(buckets)[0.0025] == 3 and dict(buckets)[100.0] == 4
    assert set(PROMETHEUS_BOUNDS) <= set(BOUNDS)


def test_recent_windows_forget_what_is_older_than_asked():
    stats = Stats(now=0.0)
    for t in range(0, 100, 2):
        stats.answered(float(t), "m", "v1", 1, [0.01], [0.001], 0.005, [0])
    minute, span = stats.recent(100.0, 60)
    assert 25 <= minute[("m", "v1")].samples <= 32 and 55 <= span <= 65
    assert stats.since_start[("m", "v1")].samples == 50


class FakeNvml(types.SimpleNamespace):
    """Just enough of pynvml, for two GPUs (the second a MIG instance, without utilisation)."""

    NVML_TEMPERATURE_GPU = 0
    UUIDS = ("GPU-aaa", "GPU-abc")

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[object] = []

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        self.asked.append(index)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(uuid)
        if uuid not in self.UUIDS:
            raise self.NVMLError("not found")
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetUUID(self, handle):
        return self.UUIDS[handle].encode()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=1000 + handle, total=8000)

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=42)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 61

    def nvmlDeviceGetPowerUsage(self, handle):
        raise RuntimeError("not supported on this board")


def test_gpu_probe_maps_cuda_indices_through_cuda_visible_devices(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,GPU-ab")
    probes = Probes()
    first = probes.gpu("cuda:0")
    assert first == {"gpu_memory_used_bytes": 1000, "gpu_memory_total_bytes": 8000, "gpu_utilization": 0.42,
                     "gpu_temperature_c": 61}, "a sensor the board lacks is left out"
    second = probes.gpu("cuda:1")  # named by the start of its UUID, as CUDA allows; a MIG instance
    assert second == {"gpu_memory_used_bytes": 1001, "gpu_memory_total_bytes": 8000, "gpu_temperature_c": 61}
    assert fake.asked[:2] == [0, "GPU-ab"]
    assert probes.gpu("cpu") == {}


def test_workers_number_gpus_as_nvml_does_unless_the_operator_said_otherwise(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "")  # so that monkeypatch puts back what the test's process had
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    resolve_devices(("cpu",))
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    resolve_devices(("cpu",))
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_without_nvml_gpu_fields_are_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert Probes().gpu("cuda:0") == {}


def test_process_probe_reads_rss_and_cpu(monkeypatch):
    probes = Probes()
    first = probes.process(os.getpid())
    assert first["rss_bytes"] > 0 and first["cpu_percent"] >= 0
    assert probes.process(None) == {} and probes.process(2**22 + 12345) == {}
