"""NVML (nvidia-ml-py) for the supervisor, which never loads CUDA: start-up, and CUDA's device numbering."""

from __future__ import annotations

import os
from types import ModuleType

NvmlId = int | str  # an NVML device index, or a UUID (or MIG id) as CUDA_VISIBLE_DEVICES may name one


def open_nvml() -> ModuleType | None:
    """pynvml, initialised; None on a machine without the NVIDIA driver or library."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: a machine without NVIDIA GPUs
        return None
    return pynvml


def cuda_devices(nvml_count: int, visible: str | None = None) -> list[NvmlId]:
    """What CUDA calls device 0, 1, ... in this process, as NVML ids, following CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return list(range(nvml_count))
    devices: list[NvmlId] = []
    for entry in (e.strip() for e in visible.split(",")):
        # CUDA stops at the first entry it cannot use.
        if not entry or entry.startswith("-") or (entry.isdigit() and int(entry) >= nvml_count):
            break
        devices.append(int(entry) if entry.isdigit() else entry)
    return devices[:nvml_count]
