from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items) -> None:
    """Long soaks (marked `soak`) run only under SRV_SOAK=1 (`make soak`), not in `make test`."""
    if os.environ.get("SRV_SOAK") == "1":
        return
    soaks = [item for item in items if "soak" in item.keywords]
    if soaks:
        config.hook.pytest_deselected(items=soaks)
        items[:] = [item for item in items if "soak" not in item.keywords]


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


# ---- models for engine tests: the default GGUF, converted once, and tiny random ones ----


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from srv.engine.default_model import default_model_path
    from srv.plugins.models.loaders import GGUFLoader

    return GGUFLoader().prepare(default_model_path())


def build_tiny_model(root: Path, kind: str, tokenizer_dir: Path) -> Path:
    """A random-weight model from a config, saved as safetensors with the default tokenizer."""
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "qwen2":  # biases on the query/key/value projections
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    else:
        model = tiny_moe(kind, common)
    path = root / kind
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_moe(kind: str, common: dict):
    """Mixtures of experts of every routing the native layers take: Mixtral (4 experts, weights
    renormalised), Qwen2-MoE (a gated shared expert, layer 1 dense), Qwen3-MoE (per-head norms,
    renormalised), OLMoE (norms over the whole query and key projections)."""
    import transformers

    common = {**common, "tie_word_embeddings": False}
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{**common, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=False))
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **{**common, "intermediate_size": 48}, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False))


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {kind: build_tiny_model(root, kind, default_model_dir) for kind in MOE_KINDS}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_model(root, kind, default_model_dir) for kind in ("llama", "qwen2", "qwen3")}
