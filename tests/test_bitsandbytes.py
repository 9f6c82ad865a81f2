"""`--quantization bitsandbytes` (kit in test_sdk_testing.py): a float checkpoint quantized at load
to NF4, and checkpoints transformers saved in bitsandbytes' format, against transformers on
bitsandbytes' own dequantized weights; the default model within the stated bound."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import srv
from srv.plugins.quantization.bitsandbytes_method import blocksize
from srv.sdk.testing.quantization import measure_accuracy
from srv.sdk.testing.tiny_model import hf_greedy

TOP1_LOGPROB_ERROR_BOUND = 0.50
GREEDY_AGREEMENT_BOUND = 0.75


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decodes_transformers_greedy_tokens_on_the_dequantized_weights(tiny_models, kind):
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_models[kind]), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                packed, state = bnb_functional.quantize_4bit(module.weight.data, quant_type="nf4",
                                                             blocksize=blocksize(module.in_features))
                module.weight.copy_(bnb_functional.dequantize_4bit(packed, state))
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with srv.Engine(model_path=str(tiny_models[kind]), quantization="bitsandbytes", dtype="float32",
                    max_total_tokens=1024) as engine:
        assert engine.runner.model.layers[0].self_attn.qkv_proj.packed.dtype == torch.uint8
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                      "ignore_eos": True})
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 8) for p in prompts]


@pytest.mark.parametrize("quant_type,nested,model_impl", [("nf4", True, "auto"), ("fp4", False, "auto"),
                                                          ("nf4", False, "transformers")])
def test_stored_checkpoints_are_read_as_transformers_saves_them(tiny_models, tmp_path, quant_type, nested,
                                                                model_impl):
    """A checkpoint transformers quantized and saved: the fused projections hold each shard's
    weights exactly as bitsandbytes dequantizes them, and decode its greedy tokens."""
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
                                bnb_4bit_compute_dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), quantization_config=config,
                                                     device_map="cpu")
    quantized.save_pretrained(tmp_path / "bnb")
    shutil.copy(tiny_models["llama"] / "tokenizer.json", tmp_path / "bnb")
    shutil.copy(tiny_models["llama"] / "tokenizer_config.json", tmp_path / "bnb")
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    dequantized = {}
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if hasattr(module.weight if hasattr(module, "weight") else None, "quant_state"):
                dequantized[name] = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                reference.get_submodule(name).weight.copy_(dequantized[name])
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with srv.Engine(model_path=str(tmp_path / "bnb"), dtype="float32", max_total_tokens=1024,
                    model_impl=model_impl) as engine:
        assert engine.runner.quantization_name == "bitsandbytes"
        if model_impl == "auto":
            qkv = engine.runner.model.layers[0].self_attn.qkv_proj
            expected = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
            assert torch.equal(bnb_functional.dequantize_4bit(qkv.packed, qkv.quant_state), expected)
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                      "ignore_eos": True})
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 8) for p in prompts]


def test_an_8bit_checkpoint_is_refused(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="8-bit"):
        srv.Engine(model_path=str(tmp_path / "m"), dtype="float32", max_total_tokens=256)


def test_default_model_within_the_stated_bound():
    accuracy = measure_accuracy(srv.Engine, {"dtype": "float32", "quantization": "bitsandbytes"})
    assert accuracy.top1_logprob_error <= TOP1_LOGPROB_ERROR_BOUND, accuracy
    assert accuracy.greedy_agreement >= GREEDY_AGREEMENT_BOUND, accuracy
