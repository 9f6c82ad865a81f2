"""Where srv and its plugins keep what they build once per machine and reuse at every launch
(converted checkpoints, compiled kernels, repacked weights): $SRV_CACHE_DIR, or ~/.cache/srv;
and how a file gets there when several processes may build it at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("SRV_CACHE_DIR") or Path.home() / ".cache" / "srv").expanduser()


def write_atomically(path: Path, write: Callable[[Path], object], mode: int | None = None) -> None:
    """Create or replace `path` with what `write` puts at the temporary path it is given, beside
    `path`, then renamed: a concurrent reader finds the old file or the new one, never half of
    one. `mode` sets the file's permissions (a shared cache needs files others can read, which
    some writers make private). If `write` raises, nothing is left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
