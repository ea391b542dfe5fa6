"""What the operating system and the GPU driver say about the workers.

Host memory and CPU come from psutil, GPU memory, utilisation, temperature and
power from NVML (nvidia-ml-py). Both are read by the supervisor, so no worker
has to stop serving to answer; where there is no NVML the GPU fields are
simply absent.
"""

from __future__ import annotations

import logging
from typing import Any

import psutil

from inferd.supervisor.processes.nvml import NvmlId, cuda_devices, open_nvml

log = logging.getLogger("inferd.probes")


class Probes:
    """Reads process and GPU figures; keeps handles between reads (CPU % needs a previous sample)."""

    def __init__(self) -> None:
        self._processes: dict[int, psutil.Process] = {}
        self._nvml: Any = open_nvml()
        self._cuda: list[NvmlId] = cuda_devices(self._nvml.nvmlDeviceGetCount()) if self._nvml else []

    def close(self) -> None:
        """Release NVML."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down; nothing to do about it
                pass
            self._nvml = None

    def process(self, pid: int | None) -> dict[str, Any]:
        """rss_bytes and cpu_percent of a process (CPU % since the previous read of the same pid)."""
        if pid is None:
            return {}
        proc = self._processes.get(pid)
        try:
            if proc is None:
                proc = self._processes[pid] = psutil.Process(pid)
                proc.cpu_percent(None)
            with proc.oneshot():
                return {"rss_bytes": proc.memory_info().rss, "cpu_percent": proc.cpu_percent(None)}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            self._processes.pop(pid, None)
            return {}

    def forget(self, live_pids: set[int]) -> None:
        """Drop handles of processes that are gone."""
        for pid in list(self._processes):
            if pid not in live_pids:
                del self._processes[pid]

    def gpu(self, device: str) -> dict[str, Any]:
        """Memory used and total, utilisation (0..1), temperature (C) and power (W) of a `cuda:N` device."""
        if self._nvml is None or not device.startswith("cuda:"):
            return {}
        nvml = self._nvml
        try:
            handle = self._handle(int(device.split(":")[1]))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            info: dict[str, Any] = {
                "gpu_memory_used_bytes": int(memory.used),
                "gpu_memory_total_bytes": int(memory.total),
            }
        except Exception as exc:  # noqa: BLE001 - NVML errors are many; a probe must never break stats
            log.debug("NVML cannot read %s: %s", device, exc)
            return {}
        for key, read in (  # a MIG instance reports no utilisation
            ("gpu_utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100),
            ("gpu_temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            ("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
        ):
            try:
                info[key] = read()
            except Exception:  # noqa: BLE001 - not every board reports every sensor
                pass
        return info

    def _handle(self, cuda_index: int) -> Any:
        """The NVML handle of what CUDA calls device `cuda_index` (CUDA_VISIBLE_DEVICES renumbers them)."""
        device = self._cuda[cuda_index]
        if isinstance(device, int):
            return self._nvml.nvmlDeviceGetHandleByIndex(device)
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID(device)
        except self._nvml.NVMLError:  # CUDA_VISIBLE_DEVICES may name a GPU by the start of its UUID
            for index in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = self._nvml.nvmlDeviceGetUUID(handle)
                if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(device):
                    return handle
            raise
