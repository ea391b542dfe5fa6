"""Which devices get a worker, found without importing CUDA into the supervisor."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("inferd.devices")


def _nvml_device_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: a machine without GPUs
        return 0
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def visible_gpu_count() -> int:
    """GPUs this process may use: NVML's count, narrowed by CUDA_VISIBLE_DEVICES as CUDA would."""
    count = _nvml_device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    usable = 0
    for entry in visible.split(","):
        entry = entry.strip()
        # CUDA stops at the first entry it cannot use.
        if not entry or (entry.isdigit() and int(entry) >= count) or entry.startswith("-"):
            break
        usable += 1
    return min(usable, count)


def resolve_devices(setting: str | tuple[str, ...]) -> list[str]:
    """The device of each worker: "auto" means every visible GPU, else one CPU worker."""
    if setting != "auto":
        return list(setting)
    gpus = visible_gpu_count()
    devices = [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    log.info("devices: %s", ", ".join(devices))
    return devices
