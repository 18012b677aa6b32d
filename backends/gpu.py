"""Real GPU utilisation through NVML, when there is a GPU and ``pynvml`` (nvidia-ml-py).

Optional by design: the reference worker must run on laptops and CI machines without a GPU,
so every failure (no package, no driver, no device) means "no reading" and the worker falls
back to its simulated utilisation.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["NvmlGpu", "open_gpu"]

log = logging.getLogger(__name__)


def _visible_indices(count: int) -> list[int]:
    """Devices this process may use: ``CUDA_VISIBLE_DEVICES`` when it lists indices, else all."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return list(range(count))
    try:
        wanted = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:  # UUIDs or MIG names: NVML indices cannot be derived simply
        return list(range(count))
    return [i for i in wanted if 0 <= i < count]


class NvmlGpu:
    """Utilisation of the visible GPUs (mean of their ``gpu`` utilisation rates), 0..1."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles

    @property
    def devices(self) -> int:
        """Number of GPUs read."""
        return len(self._handles)

    def utilization(self) -> float | None:
        """Current utilisation in 0..1, or None if NVML stopped answering."""
        try:
            rates = [float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
        except Exception as exc:  # NVMLError and friends: a reading is best effort
            log.debug("NVML read failed: %s", exc)
            return None
        return min(1.0, max(0.0, sum(rates) / len(rates) / 100.0)) if rates else None

    def close(self) -> None:
        """Release NVML."""
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("NVML shutdown failed: %s", exc)


def open_gpu() -> NvmlGpu | None:
    """Open NVML and the visible GPUs; None if NVML or a GPU is not available."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        log.debug("NVML init failed: %s", exc)
        return None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(count)]
    except Exception as exc:
        log.debug("NVML device lookup failed: %s", exc)
        handles = []
    gpu = NvmlGpu(pynvml, handles)
    if not handles or gpu.utilization() is None:
        gpu.close()
        return None
    return gpu
