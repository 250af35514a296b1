"""Peak memory of a block of code: max allocated on CUDA, peak resident set size on CPU."""

from __future__ import annotations

import os
import threading
import time

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class PeakMemory:
    """Context manager; ``peak_mb`` after exit. On CPU a thread samples the RSS every ``interval_s``."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.002):
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, current_rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._peak = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, current_rss_bytes())
            self.peak_mb = self._peak / 2**20
