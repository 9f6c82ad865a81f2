from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_srv(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the `srv` command line in a child process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "srv", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


class FakeDistributions:
    """Installed-looking distributions (dist-info with entry points) in a folder for PYTHONPATH."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, distribution: str, entry_points: dict[str, str], modules: dict[str, str],
            version: str = "1.0") -> None:
        info = self.root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        lines = ["[srv]"] + [f"{name} = {target}" for name, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))

    @property
    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join([str(self.root), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def fake_dists(tmp_path: Path) -> FakeDistributions:
    return FakeDistributions(tmp_path / "site")
