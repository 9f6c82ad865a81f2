"""Process-wide diagnostics shared by the HTTP and scheduler processes."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger("srv.gc")


def install_gc_warning(threshold_s: float) -> None:
    """--gc-warning-threshold-secs: warn when one garbage collection pass takes longer (0: off).
    A long pause stalls every request of the process, so it is worth a line in the log."""
    if threshold_s <= 0:
        return
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            took = time.perf_counter() - started[0]
            if took > threshold_s:
                logger.warning("garbage collection of generation %d took %.3f s (collected %d objects)",
                               info["generation"], took, info.get("collected", 0))

    gc.callbacks.append(callback)
