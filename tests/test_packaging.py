"""The wheel installs srv and its built-in plugins under the `srv` namespace and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
                   check=True, capture_output=True)
    [built] = out.glob("srv-*.whl")
    return built


def test_wheel_holds_only_the_srv_namespace(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"srv"}
    assert "srv/plugins/cache/__init__.py" in names
    assert "srv/args/server_arguments.yaml" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for family in ("attention", "cache", "models", "sampling", "scheduling"):
        assert f"{family} = srv.plugins.{family}" in text
    assert "srv = srv.cli.main:main" in text


def test_fresh_virtualenv_install_lists_builtin_plugins(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "-c", str(ROOT / "constraints.txt"), str(wheel)], check=True, capture_output=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert not (Path(site) / "core").exists() and not (Path(site) / "plugins").exists()
    result = subprocess.run([str(env_dir / "bin" / "srv"), "plugins", "--json"], capture_output=True, text=True,
                            cwd=tmp_path, check=True)
    report = json.loads(result.stdout)
    assert {"attention", "cache", "models", "sampling", "scheduling"} <= {
        p["name"] for p in report["plugins"] if p["distribution"] == "srv"}
    assert {b["name"] for b in report["backends"]["eviction_policy"]} >= {"lru", "lfu"}
