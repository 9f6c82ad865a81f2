"""compressed-tensors checkpoints compressed by compressed-tensors itself (its int-quantized and
float-quantized compressors; pack-quantized in test_packed_int.py): the weights srv serves
equal the library's own decompression exactly, and decode transformers' greedy tokens on them."""

from __future__ import annotations

import pytest
import torch
from quantized_checkpoints import write_quantized_checkpoint

import srv
from srv.plugins.quantization.fp8 import dequantize
from srv.sdk.testing.tiny_model import hf_greedy

SCHEMES = {
    "int8-channel": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                     {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                    {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
    "fp8-tensor": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
                   None),
}


def served_weight(layer) -> torch.Tensor:
    """The float weights a w8a8_int8 or fp8 layer computes with."""
    if hasattr(layer, "int8"):
        return layer.int8.q.float() * layer.int8.scale[:, None]
    fp8 = layer.fp8
    return dequantize(fp8.w8, fp8.scale, fp8.block_k, torch.float32)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_weights_equal_the_librarys_decompression(tiny_models, tmp_path, name):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt, weights, activations = SCHEMES[name]
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=None if activations is None else QuantizationArgs(**activations))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    largest = 127.0 if weights["type"] == "int" else 448.0
    def quantize_layer(key, tensor):
        maximum = tensor.abs().amax(1, keepdim=True) if weights["strategy"] == "channel" else tensor.abs().max()
        state = {"weight": tensor, "weight_scale": (maximum / largest).float(),
                 "weight_zero_point": torch.zeros_like(maximum, dtype=torch.int8 if largest == 127 else tensor.dtype)}
        compressed = compressor.compress(state, scheme)
        compressed.pop("weight_zero_point", None)
        return compressed, compressor.decompress(dict(compressed), scheme)["weight"].float()

    source, target = tiny_models["qwen2"], tmp_path / name
    quantization = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                                  "input_activations": scheme.input_activations and
                                                  scheme.input_activations.model_dump(mode="json")}}}
    decompressed = write_quantized_checkpoint(source, target, quantize_layer, quantization)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with srv.Engine(model_path=str(target), dtype="float32", max_total_tokens=1024) as engine:
        attention = engine.runner.model.layers[0].self_attn
        expected = torch.cat([decompressed[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(served_weight(attention.qkv_proj), expected)
        assert torch.equal(served_weight(attention.o_proj), decompressed["model.layers.0.self_attn.o_proj.weight"])
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                      "ignore_eos": True})
    if weights["type"] == "float":   # weight-only: the same products as transformers on these weights
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
        reference.load_state_dict(decompressed, strict=False)
        assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 8) for p in prompts]
