"""The GPU's clocks, power and temperature while a benchmark times, read from NVML (nvidia-ml-py's `pynvml`, where
installed).

Two machines of one kind that measure the same copy bandwidth have run the same 27B round 3-5% apart (BENCHMARKS.md):
the weight products follow the memory, but a round's few hundred small kernels follow the SM clock, and a power or
thermal cap lowers it. `Clocks` samples the device in a thread while a case is timed, so a row can say which clock it
ran at and whether anything capped it.

    with Clocks(0) as clocks:
        time_rounds(...)
    row["clocks"] = clocks.summary()  # {} where NVML cannot be read
"""

from __future__ import annotations

import statistics
import threading
from types import ModuleType, TracebackType
from typing import Any, Self

# NVML's clock-event (throttle) reason bits, as nvml.h names them
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def _nvml() -> ModuleType | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - not installed, or no driver: the benchmark runs without clock figures
        return None


class Clocks:
    """Samples device `index` every `period` seconds between enter and exit."""

    def __init__(self, index: int, period: float = 0.05) -> None:
        self.index, self.period = index, period
        self.samples: list[tuple[int, int, float, int, int]] = []  # (sm MHz, memory MHz, W, deg C, reason bits)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = _nvml()

    def _sample(self, nvml: Any, handle: Any) -> None:
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)  # older nvidia-ml-py: Throttle
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while True:
            self.samples.append((nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                                 nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                                 nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                                 nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                                 int(reasons(handle))))
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> Self:
        if self._nvml is not None:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(self.index)
            self._thread = threading.Thread(target=self._sample, args=(self._nvml, handle), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Medians of the SM and memory clocks and the power, the lowest SM clock, the hottest temperature and every
        reason NVML gave for a clock below its maximum (gpu_idle aside); {} without samples."""
        if not self.samples:
            return {}
        sm, mem, watts, temp, bits = zip(*self.samples, strict=True)
        seen = 0
        for b in bits:
            seen |= b
        return {"samples": len(sm), "sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm),
                "mem_mhz": statistics.median(mem), "power_w": round(statistics.median(watts), 1),
                "temp_c_max": max(temp), "capped_by": [name for bit, name in REASONS.items()
                                                       if seen & bit and name != "gpu_idle"]}
