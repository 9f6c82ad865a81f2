"""`--quantization fp8` and `w8a8_fp8` (kit in test_sdk_testing.py): float8 e4m3fn weights with
per-tensor, per-channel and block scales, computed weight-only. The kernels against the
dequantized product, the checkpoint layouts against transformers on the dequantized weights, and
the default model within the stated bound."""

from __future__ import annotations

import ctypes

import pytest
import torch
from quantized_checkpoints import write_quantized_checkpoint

import srv
from srv.plugins.quantization.fp8 import Fp8Weight, dequantize, kernels, quantize_weight
from srv.sdk import requires_cpu_flags
from srv.sdk.testing.quantization import measure_accuracy
from srv.sdk.testing.tiny_model import hf_greedy

TOP1_LOGPROB_ERROR_BOUND = 0.20
GREEDY_AGREEMENT_BOUND = 0.85


def test_every_e4m3_byte_widens_as_torch_reads_it():
    """The kernel widens all 255 non-NaN bytes to torch's values (one-hot rows pick each weight)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w8 = codes.view(torch.float8_e4m3fn).reshape(-1, 1).repeat(1, 8).contiguous()
    for isa in [0, 1] if requires_cpu_flags("avx2", "fma", "f16c")().ok else [0]:
        weight = Fp8Weight(w8, torch.ones(w8.shape[0], 1), 8, None, isa)
        x = torch.zeros(1, 8)
        x[0, 3] = 1.0
        y = torch.empty(1, w8.shape[0])
        kernels().srv_fp8_linear(ctypes.addressof(weight.context), x.data_ptr(), 1, y.data_ptr())
        assert torch.equal(y[0], w8[:, 3].float()), isa


@pytest.mark.parametrize("block_k", [16, 40, 100])
def test_kernels_compute_the_dequantized_product(block_k):
    generator = torch.Generator().manual_seed(0)
    n, k = 48, 100
    w8 = (torch.randn(n, k, generator=generator) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // block_k), generator=generator) + 0.5
    bias = torch.randn(n, generator=generator)
    reference_weight = dequantize(w8, scale, block_k, torch.float64)
    for isa in [0, 1] if requires_cpu_flags("avx2", "fma", "f16c")().ok else [0]:
        weight = Fp8Weight(w8, scale, block_k, bias, isa)
        for rows in (1, 3, 5, 15):
            x = torch.randn(rows, k, generator=generator)
            expected = (x.double() @ reference_weight.t() + bias.double()).float()
            torch.testing.assert_close(weight.matmul(x, torch.float32), expected, rtol=1e-5, atol=1e-3)


def write_fp8_checkpoint(source, target, layout):
    """The float checkpoint `source` in float8, as the formats store it; returns the dequantized
    float weights (what transformers is given as the reference)."""
    def quantize_layer(name, tensor):
        if layout == "tensor":
            scale = tensor.abs().max() / 448
            w8 = (tensor / scale).to(torch.float8_e4m3fn)
            return {"weight": w8, "weight_scale": scale.reshape(())}, w8.float() * scale
        if layout == "channel":
            w8, scale = quantize_weight(tensor)
            return {"weight": w8, "weight_scale": scale}, w8.float() * scale
        n, k = tensor.shape   # 32 x 32 blocks
        blocks = tensor.reshape(n // 32, 32, k // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        w8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
        return ({"weight": w8, "weight_scale_inv": scale},
                dequantize(w8, scale.repeat_interleave(32, 0), 32, torch.float32))

    quantization = {"tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
                    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
                    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                "ignore": ["lm_head"], "config_groups": {"group_0": {
                                    "targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                "strategy": "channel", "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                          "strategy": "token", "dynamic": True}}}}}[layout]
    return write_quantized_checkpoint(source, target, quantize_layer, quantization)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_checkpoints_match_transformers_on_their_dequantized_weights(tiny_models, tmp_path, kind, layout):
    """Each layout is read as stored (the method inferred from the config), the fused shards
    keeping their own scales, and decodes transformers' greedy tokens on the same values."""
    from transformers import AutoModelForCausalLM

    dequantized = write_fp8_checkpoint(tiny_models[kind], tmp_path / kind, layout)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_models[kind]), dtype=torch.float32).eval()
    reference.load_state_dict(dequantized, strict=False)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with srv.Engine(model_path=str(tmp_path / kind), dtype="float32", max_total_tokens=1024) as engine:
        qkv = engine.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.fp8.w8.dtype == torch.float8_e4m3fn
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                      "ignore_eos": True})
    for prompt, result in zip(prompts, results):
        assert result["output_ids"] == hf_greedy(reference, prompt, 8)


def test_default_model_within_the_stated_bound():
    accuracy = measure_accuracy(srv.Engine, {"dtype": "float32", "quantization": "fp8"})
    assert accuracy.top1_logprob_error <= TOP1_LOGPROB_ERROR_BOUND, accuracy
    assert accuracy.greedy_agreement >= GREEDY_AGREEMENT_BOUND, accuracy


@pytest.mark.parametrize("kind, layout", [("qwen2_moe", "block"), ("qwen3_moe", "channel"), ("qwen3_moe", "tensor")])
def test_fp8_moe_checkpoints_read_their_experts_as_stored(tiny_moe_models, tmp_path, kind, layout):
    """Each expert's float8 projections and scales are read as stored and widened to float: the
    same greedy tokens as the float checkpoint of the dequantized weights."""
    import shutil

    from safetensors.torch import save_file

    dequantized = write_fp8_checkpoint(tiny_moe_models[kind], tmp_path / "fp8", layout)
    shutil.copytree(tiny_moe_models[kind], tmp_path / "float")
    save_file(dequantized, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outputs = []
    for path in ("fp8", "float"):
        with srv.Engine(model_path=str(tmp_path / path), dtype="float32", max_total_tokens=1024) as engine:
            if path == "fp8":
                experts = engine.runner.model.layers[0].mlp.experts
                assert torch.equal(experts.experts().w13[0, :4],
                                   dequantized["model.layers.0.mlp.experts.0.gate_proj.weight"][:4])
            outputs.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)])
    assert outputs[0] == outputs[1]
