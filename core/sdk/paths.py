"""Where srv and its plugins keep what they build once per machine and reuse at every launch
(converted checkpoints, compiled kernels, repacked weights): $SRV_CACHE_DIR, or ~/.cache/srv."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SRV_CACHE_DIR") or Path.home() / ".cache" / "srv").expanduser()
