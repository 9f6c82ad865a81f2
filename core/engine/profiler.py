"""`/start_profile` and `/stop_profile`: torch.profiler around the scheduler's steps, written as
a Chrome trace (open it in Perfetto or chrome://tracing), as SGLang writes its traces."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("srv.scheduler")

# SGLang's variable for where traces go when a request names no folder.
PROFILER_DIR_VARIABLE = "SGLANG_TORCH_PROFILER_DIR"
ACTIVITIES = {"CPU", "MEM"}   # what a CPU machine can record (GPU and CUDA need a GPU)


class StepProfiler:
    def __init__(self) -> None:
        self._profile: Any = None
        self._path: Path | None = None
        self._steps_left: int | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str | None = None, num_steps: int | None = None,
              activities: list[str] | None = None, record_shapes: bool = False, with_stack: bool = False,
              profile_id: str | None = None) -> str:
        """Start recording; returns the trace's path (written at the stop, or after num_steps steps)."""
        import torch.profiler

        if self.running:
            raise ValueError("a profile is already being recorded: /stop_profile first")
        wanted = set(activities or ["CPU"])
        unknown = wanted - ACTIVITIES
        if unknown:
            raise ValueError(f"activities {sorted(unknown)} cannot be recorded here (this machine records "
                             f"{', '.join(sorted(ACTIVITIES))})")
        folder = Path(output_dir or os.environ.get(PROFILER_DIR_VARIABLE) or "/tmp/srv-profiles")
        folder.mkdir(parents=True, exist_ok=True)
        self._path = folder / f"{profile_id or time.strftime('%Y%m%d-%H%M%S')}-TP-0.trace.json.gz"
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               record_shapes=record_shapes, with_stack=with_stack,
                                               profile_memory="MEM" in wanted)
        self._profile.__enter__()
        self._steps_left = num_steps
        logger.info("profiling the scheduler's steps into %s%s", self._path,
                    f" for {num_steps} steps" if num_steps else "")
        return str(self._path)

    def after_step(self) -> None:
        """Counts a step; ends the recording after the asked number of them."""
        if self._steps_left is None or not self.running:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()

    def stop(self) -> str:
        if not self.running:
            raise ValueError("no profile is being recorded: /start_profile first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        profile.export_chrome_trace(str(self._path))
        logger.info("profile written to %s", self._path)
        return str(self._path)
