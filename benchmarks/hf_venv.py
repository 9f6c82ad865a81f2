"""The HF peer's own virtual environment, outside srv's dependencies, cached between runs.

torch is pinned to 2.13.0, the CPU build this project's machines carry (any other spec fetches
gigabytes of CUDA wheels); transformers to the version srv itself runs, so both read the weights
the same way.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("benchmarks")

STAMP = "srv-bench-packages.json"


def default_packages() -> tuple[str, ...]:
    return ("torch==2.13.0", f"transformers=={importlib.metadata.version('transformers')}")


@dataclass(frozen=True)
class HfVenv:
    packages: tuple[str, ...] = field(default_factory=default_packages)
    root: Path = field(default_factory=lambda: Path.home() / ".cache" / "srv" / "bench" / "hf-venv")

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def is_ready(self) -> bool:
        try:
            return json.loads((self.root / STAMP).read_text()) == list(self.packages) and self.python.is_file()
        except (OSError, ValueError):
            return False


def ensure_hf_venv(venv: HfVenv) -> Path:
    """The HF venv's python, creating the venv and installing its packages when needed."""
    if venv.is_ready():
        logger.info("hf: cached venv %s (%s)", venv.root, ", ".join(venv.packages))
        return venv.python
    shutil.rmtree(venv.root, ignore_errors=True)
    logger.info("hf: creating venv %s", venv.root)
    subprocess.run([sys.executable, "-m", "venv", str(venv.root)], check=True)
    logger.info("hf: installing %s", " ".join(venv.packages))
    done = subprocess.run([str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           *venv.packages], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(venv.packages)} failed:\n{done.stderr[-2000:]}")
    (venv.root / STAMP).write_text(json.dumps(list(venv.packages)) + "\n")
    logger.info("hf: venv ready")
    return venv.python
