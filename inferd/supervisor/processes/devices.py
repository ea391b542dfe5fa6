"""Which devices get a worker, found without importing CUDA into the supervisor."""

from __future__ import annotations

import logging
import os

from inferd.supervisor.processes.nvml import cuda_devices, open_nvml

log = logging.getLogger("inferd.devices")


def visible_gpu_count() -> int:
    """GPUs this process may use: NVML's count, narrowed by CUDA_VISIBLE_DEVICES as CUDA would."""
    nvml = open_nvml()
    if nvml is None:
        return 0
    try:
        return len(cuda_devices(nvml.nvmlDeviceGetCount()))
    finally:
        nvml.nvmlShutdown()


def resolve_devices(setting: str | tuple[str, ...]) -> list[str]:
    """The device of each worker: "auto" means every visible GPU, else one CPU worker.

    The workers (which inherit this process's environment) number GPUs as NVML does, by PCI bus, unless
    the operator set CUDA_DEVICE_ORDER: CUDA's own default puts the fastest first, and on a machine of
    mixed GPUs a worker's cuda:N would then not be the board the stats read as N.
    """
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if setting != "auto":
        return list(setting)
    devices = [f"cuda:{i}" for i in range(visible_gpu_count())] or ["cpu"]
    log.info("devices: %s", ", ".join(devices))
    return devices
