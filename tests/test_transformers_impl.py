"""`--model-impl transformers`: transformers' own modules, their attention on srv's KV cache,
give HF's greedy output token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srv.engine.default_model import default_model_path
from srv.plugin_manager import load_plugins
from srv.sdk.models import materialize
from test_engine import GREEDY, assert_all_kv_returned, assert_matches_hf, make_engine, random_prompts

ATTENTION_BACKENDS = load_plugins()[1].names("attention")
NATIVE_MODULE = "srv.plugins.models.llama"
TRANSFORMERS_MODULE = "srv.plugins.models.transformers_impl"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
def test_tiny_models_match_hf(tiny_models, kind, attention):
    prompts = random_prompts(8)
    with make_engine(tiny_models[kind], model_impl="transformers", attention_backend=attention,
                     page_size=16, chunked_prefill_size=16) as engine:
        assert type(engine.runner.model).__module__ == TRANSFORMERS_MODULE
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, tiny_models[kind], prompts, results)
        assert_all_kv_returned(engine)


def test_auto_keeps_the_native_impl(tiny_models):
    assert "transformers" in load_plugins()[1].names("model_impl")
    with make_engine(tiny_models["qwen3"], max_total_tokens=256) as engine:
        assert type(engine.runner.model).__module__ == NATIVE_MODULE


def test_auto_picks_transformers_for_an_architecture_srv_lacks(tmp_path, default_model_dir):
    """PhiMoE: no native layers, and a checkpoint whose per-expert weights transformers fuses."""
    from transformers import AutoTokenizer, PhimoeConfig, PhimoeForCausalLM

    torch.manual_seed(0)
    config = PhimoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    path = tmp_path / "phimoe"
    PhimoeForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    prompts = random_prompts(4, seed=4)
    with make_engine(path) as engine:
        assert type(engine.runner.model).__module__ == TRANSFORMERS_MODULE
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, path, prompts, results)


def test_default_model_single_request(default_model_dir):
    prompt = "The capital of France is"
    with make_engine(default_model_path(), model_impl="transformers") as engine:
        assert type(engine.runner.model).__module__ == TRANSFORMERS_MODULE
        result = engine.generate(prompt, GREEDY)
        assert_matches_hf(engine, default_model_dir, [engine.tokenizer.encode(prompt)], [result])


# ---- the module on its own ----------------------------------------------------------------------


def tiny_llama_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=tie, architectures=["LlamaForCausalLM"])


def build_as_the_runner_does(config):
    from srv.plugins.models.transformers_impl import TransformersModel

    with torch.device("meta"):
        model = TransformersModel(config)
    return materialize(model)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config(tie=True)).eval()


def test_meta_build_gets_rotary_buffers_ties_and_keeps_inv_freq_float32(reference):
    model = build_as_the_runner_does(reference.config)
    model.load_weights(reference.state_dict().items())
    rotary, expected = model.hf.model.rotary_emb, reference.model.rotary_emb
    assert torch.equal(rotary.inv_freq, expected.inv_freq) and torch.equal(rotary.original_inv_freq, expected.inv_freq)
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    model.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and model.hf.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(rotary.inv_freq, expected.inv_freq)


def test_loading_is_strict(reference):
    weights = reference.state_dict()
    build_as_the_runner_does(reference.config).load_weights(
        (name, tensor) for name, tensor in weights.items() if name != "lm_head.weight")  # tied: not needed
    with pytest.raises(ValueError, match="missing"):
        build_as_the_runner_does(reference.config).load_weights(
            (name, tensor) for name, tensor in weights.items() if name != "model.norm.weight")
    with pytest.raises(ValueError, match="does not"):
        build_as_the_runner_does(reference.config).load_weights([*weights.items(), ("model.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        build_as_the_runner_does(reference.config).load_weights(
            {**weights, "model.norm.weight": torch.zeros(3)}.items())
    untied = tiny_llama_config(tie=False)
    with pytest.raises(ValueError, match="lm_head.weight"):
        build_as_the_runner_does(untied).load_weights(
            (name, tensor) for name, tensor in weights.items() if name != "lm_head.weight")


def test_supports():
    from transformers import BertConfig, Gemma2Config, GPT2Config

    from srv.plugins.models.transformers_impl import supports

    assert supports(tiny_llama_config(tie=False))
    assert supports(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert not supports(BertConfig(architectures=["BertForMaskedLM"]))
    assert not supports(Gemma2Config(architectures=["Gemma2ForCausalLM"]))  # attention logit softcapping


def test_registering_the_attention_is_idempotent():
    from transformers import AttentionInterface

    from srv.plugins.models.transformers_impl import ATTENTION_NAME, register_attention, srv_paged_attention

    register_attention()
    register_attention()
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is srv_paged_attention


REMOTE_CONFIG = '''from transformers import LlamaConfig


class SrvToyConfig(LlamaConfig):
    model_type = "srvtoy"
'''
REMOTE_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_srvtoy import SrvToyConfig


class SrvToyForCausalLM(LlamaForCausalLM):
    config_class = SrvToyConfig
'''


def test_trust_remote_code_runs_a_models_own_code(tmp_path, tiny_models):
    """A directory whose config.json maps its architecture to its own modules (auto_map) is served
    through transformers only with --trust-remote-code, and then as transformers runs it."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    path = tmp_path / "srvtoy"
    shutil.copytree(tiny_models["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="srvtoy", architectures=["SrvToyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_srvtoy.SrvToyConfig",
                            "AutoModelForCausalLM": "modeling_srvtoy.SrvToyForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_srvtoy.py").write_text(REMOTE_CONFIG)
    (path / "modeling_srvtoy.py").write_text(REMOTE_MODEL)
    with pytest.raises(ValueError, match="--trust-remote-code"):
        make_engine(path)
    prompts = random_prompts(3, seed=5)
    with make_engine(path, trust_remote_code=True) as engine:
        assert type(engine.runner.model).__module__ == TRANSFORMERS_MODULE
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).eval()
    assert type(reference).__name__ == "SrvToyForCausalLM"
    for ids, result in zip(prompts, results):
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=len(result["output_ids"]), do_sample=False, pad_token_id=0)
        assert result["output_ids"] == out[0, len(ids):].tolist()


def test_a_repository_id_is_served_from_the_local_hub_cache_at_a_revision(tmp_path, tiny_models):
    """--model-path org/name with --download-dir and --revision: the snapshot the local cache holds
    (a branch or a commit); what the cache lacks is an error, never a download."""
    import shutil

    cache = tmp_path / "hub"
    repo = cache / "models--srv-test--tiny-llama"
    for commit in ("1111111111111111111111111111111111111111", "2222222222222222222222222222222222222222"):
        shutil.copytree(tiny_models["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2222222222222222222222222222222222222222")
    prompts = random_prompts(2, seed=6)
    with make_engine("srv-test/tiny-llama", download_dir=str(cache)) as engine:
        assert engine.runner.model_dir == repo / "snapshots" / "2222222222222222222222222222222222222222"
        assert_matches_hf(engine, tiny_models["llama"], prompts, engine.generate(input_ids=prompts,
                                                                                  sampling_params=GREEDY))
    with make_engine("srv-test/tiny-llama", download_dir=str(cache),
                     revision="1111111111111111111111111111111111111111") as engine:
        assert engine.runner.model_dir.name == "1111111111111111111111111111111111111111"
    with pytest.raises(FileNotFoundError, match="never downloads"):
        make_engine("srv-test/tiny-llama", download_dir=str(cache), revision="v9")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        make_engine("srv-test/absent", download_dir=str(cache))
    with pytest.raises(ValueError, match="--revision"):
        make_engine(tiny_models["llama"], revision="main")
