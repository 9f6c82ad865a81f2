"""Third-party plugins: the packages under examples/ (installed by `make test` with pip), and a
package written by `srv plugins new`, installed with pip, tested with its kit, and served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import srv
from conftest import run_srv
from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from test_engine import PROMPTS, hf_greedy
from test_server import Server


def test_examples_are_listed_with_their_distributions():
    report = json.loads(run_srv("plugins", "--json").stdout)
    plugins = {p["distribution"]: p for p in report["plugins"]}
    assert plugins["srv-flex-attention"]["hooks"] == ["srv_register_attention_backends"]
    assert plugins["srv-sjf-scheduling"]["hooks"] == ["srv_register_schedule_policies"]
    attention = {b["name"]: b for b in report["backends"]["attention"]}
    assert attention["flex_attention"]["distribution"] == "srv-flex-attention" and attention["flex_attention"]["available"]
    assert "sjf" in {b["name"] for b in report["backends"]["schedule_policy"]}


def test_examples_are_selectable_by_their_flags():
    args = parse_launch_args(["--attention-backend", "flex_attention", "--schedule-policy", "sjf"], *load_plugins())
    assert (args.attention_backend, args.schedule_policy) == ("flex_attention", "sjf")


def test_flex_attention_example_gives_torch_natives_greedy_output():
    outputs = {}
    for backend in ("torch_native", "flex_attention"):
        with srv.Engine(dtype="float32", attention_backend=backend, schedule_policy="sjf") as engine:
            outputs[backend] = [r["output_ids"] for r in engine.generate(PROMPTS, {"max_new_tokens": 24,
                                                                                 "temperature": 0})]
    assert outputs["flex_attention"] == outputs["torch_native"]


def test_sjf_orders_by_remaining_work():
    policy = load_plugins()[1].choose("schedule_policy", "sjf").create(None)
    def req(i, prompt, cached, new):
        return SimpleNamespace(arrival_index=i, prompt_len=prompt, cached_prefix_len=cached, max_new_tokens=new)
    waiting = [req(0, 100, 0, 10), req(1, 100, 95, 10), req(2, 20, 0, 200), req(3, 30, 0, 5)]
    assert [r.arrival_index for r in policy.order(waiting)] == [1, 3, 0, 2]


def new_package(root: Path, family: str, name: str) -> dict:
    """`srv plugins new FAMILY NAME`, pip-installed into a folder of its own (not the test venv)."""
    package, target = root / f"srv-{name}", root / "site"
    result = run_srv("plugins", "new", family, name, "--dir", str(package))
    assert result.returncode == 0, result.stderr
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(package)], check=True, capture_output=True)
    env = {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    return {"package": package, "env": env}


def run_package_tests(installed: dict) -> None:
    # From a folder outside the package, so its tests import the installed copy.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(installed["package"] / "tests")], capture_output=True, text=True,
                            env={**os.environ, **installed["env"]}, cwd=installed["package"].parent)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@pytest.fixture(scope="module")
def new_plugin(tmp_path_factory) -> dict:
    return new_package(tmp_path_factory.mktemp("new-plugin"), "attention", "mykernel")


def test_new_plugin_package_passes_its_own_tests(new_plugin):
    run_package_tests(new_plugin)


def test_new_plugin_is_listed_and_serves(new_plugin, default_model_dir, monkeypatch):
    report = json.loads(run_srv("plugins", "--json", env=new_plugin["env"]).stdout)
    assert "srv-mykernel" in {p["distribution"] for p in report["plugins"]}
    monkeypatch.setenv("PYTHONPATH", new_plugin["env"]["PYTHONPATH"])
    server = Server("--attention-backend", "mykernel", "--skip-server-warmup")
    try:
        info = httpx.get(f"{server.base}/get_server_info").json()
        assert info["attention_backend"] == "mykernel"
        result = httpx.post(f"{server.base}/generate", timeout=120, json={
            "text": PROMPTS[0], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).json()
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(default_model_dir).encode(PROMPTS[0])
        assert result["output_ids"] == hf_greedy(str(default_model_dir), tuple(ids))[:16]
    finally:
        assert server.stop() == 0


def test_new_plugin_refuses_unknown_families_and_bad_names(tmp_path):
    assert run_srv("plugins", "new", "grammar", "x", "--dir", str(tmp_path / "a")).returncode == 2
    assert run_srv("plugins", "new", "attention", "1bad", "--dir", str(tmp_path / "b")).returncode == 2


@pytest.mark.parametrize("family", ["eviction_policy", "hicache_storage", "lora_backend", "moe_runner",
                                    "schedule_policy", "speculative_algorithm"])
def test_every_template_gives_a_package_that_passes_its_kit(tmp_path, family):
    run_package_tests(new_package(tmp_path, family, "demo"))
