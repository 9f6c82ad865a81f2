"""`--quantization gptq` and `awq` (kit in test_sdk_testing.py): tiny checkpoints packed here as
each format specifies (GPTQ's v1 and v2 zero points, activation order, 2, 4 and 8 bits; AutoAWQ's
interleaved words; compressed-tensors' pack-quantized, packed by compressed-tensors itself),
read by srv and compared with transformers on the same dequantized values; the kernels' path
and the dequantized path against the float product; the default model within the stated bound."""

from __future__ import annotations

import json

import pytest
import torch
from quantized_checkpoints import write_quantized_checkpoint

import srv
from srv.plugins.quantization import packed_int
from srv.sdk.testing.quantization import measure_accuracy
from srv.sdk.testing.tiny_model import hf_greedy

TOP1_LOGPROB_ERROR_BOUND = 0.55
GREEDY_AGREEMENT_BOUND = 0.70
GROUP = 32


def quantize(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool):
    """Round to nearest, per group of inputs: (q [N, K], zeros [N, G], scales [N, G]) with
    weight ~ scales[:, g] * (q - zeros[:, g]); scales rounded to float16, as checkpoints hold them."""
    n, k = weight.shape
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    q = torch.empty(n, k, dtype=torch.int32)
    zeros = torch.empty(n, groups, dtype=torch.int32)
    scales = torch.empty(n, groups)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = weight[:, cols].float()
        if symmetric:
            scale = (block.abs().amax(1) / (top // 2)).clamp_min(1e-6).half().float()
            zero = torch.full((n,), (top + 1) // 2)
        else:
            low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale = ((high - low) / top).clamp_min(1e-6).half().float()
            zero = (-low / scale).round().clamp(0, top).int()
        q[:, cols] = (block / scale[:, None] + zero[:, None]).round().clamp(0, top).int()
        zeros[:, g], scales[:, g] = zero, scale
    return q, zeros, scales


def pack_words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """values [R, C] (unsigned) into int32 words along the columns: value j of a word at bits j * bits
    (with `order`, slot j holds column order[j] of the word's eight)."""
    per_word = 32 // bits
    grouped = values.reshape(values.shape[0], -1, per_word).long()
    if order is not None:
        grouped = grouped[..., list(order)]
    words = torch.zeros(grouped.shape[:2], dtype=torch.long)
    for j in range(per_word):
        words |= grouped[..., j] << (j * bits)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def group_index(k: int, act_order: bool) -> torch.Tensor:
    """Each input's group: in order, or (as GPTQ's desc_act leaves it) a fixed shuffle of them."""
    g_idx = torch.arange(k) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
    return g_idx.int()


def layer_tensors(fmt: str, weight: torch.Tensor, bits: int, act_order: bool):
    """One layer's checkpoint tensors in `fmt` and its dequantized float weight."""
    g_idx = group_index(weight.shape[1], act_order)
    symmetric = fmt == "gptq-sym"
    q, zeros, scales = quantize(weight, bits, g_idx, symmetric)
    dequantized = scales[:, g_idx.long()] * (q - zeros[:, g_idx.long()]).float()
    if fmt.startswith("gptq"):
        stored_zeros = zeros - 1 if fmt != "gptq-v2" else zeros
        return {"qweight": pack_words(q, bits).t().contiguous(),
                "qzeros": pack_words(stored_zeros.t().contiguous() & ((1 << bits) - 1), bits),
                "scales": scales.t().contiguous().half(), "g_idx": g_idx}, dequantized
    assert fmt == "awq"
    return {"qweight": pack_words(q.t().contiguous(), 4, packed_int.AWQ_ORDER),
            "qzeros": pack_words(zeros.t().contiguous(), 4, packed_int.AWQ_ORDER),
            "scales": scales.t().contiguous().half()}, dequantized


def write_packed_checkpoint(source, target, fmt: str, bits: int = 4, act_order: bool = False):
    """The float checkpoint `source` in `fmt`; returns the dequantized float weights."""
    if fmt == "awq":
        quantization = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    else:
        quantization = {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order,
                        "sym": fmt == "gptq-sym", "checkpoint_format": "gptq_v2" if fmt == "gptq-v2" else "gptq"}
    return write_quantized_checkpoint(source, target, lambda name, tensor: layer_tensors(fmt, tensor, bits, act_order),
                                      quantization)


def generate(path, **args):
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    with srv.Engine(model_path=str(path), dtype="float32", max_total_tokens=1024, **args) as engine:
        layer = engine.runner.model.layers[0].self_attn.qkv_proj
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                      "ignore_eos": True})
        return prompts, [r["output_ids"] for r in results], layer


def reference_greedy(source, dequantized, prompts):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    reference.load_state_dict(dequantized, strict=False)
    return [hf_greedy(reference, prompt, 8) for prompt in prompts]


@pytest.mark.parametrize("kind,fmt,bits,act_order", [
    ("llama", "gptq", 4, False), ("qwen2", "gptq", 4, True), ("llama", "gptq-v2", 4, False),
    ("llama", "gptq-sym", 8, False), ("llama", "gptq", 2, False), ("qwen2", "awq", 4, False),
    ("llama", "awq", 4, False)])
def test_packed_checkpoints_match_transformers_on_their_dequantized_weights(tiny_models, tmp_path, kind, fmt,
                                                                            bits, act_order):
    """Each layout is read as stored (the method from the config), fused shards unpacked from
    their own words, and decodes transformers' greedy tokens on the same values."""
    dequantized = write_packed_checkpoint(tiny_models[kind], tmp_path / kind, fmt, bits, act_order)
    prompts, outputs, qkv = generate(tmp_path / kind)
    packed = qkv.packed
    expected = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(packed.dequantized(), expected)
    kernels = packed_int.kernels_available()
    # Q4_1 or Q8_0 blocks where the kernels run and the layout maps onto them; 2-bit and
    # asymmetric 8-bit stay dequantized.
    assert (packed.block is not None) == (kernels and (bits == 4 or fmt == "gptq-sym"))
    assert (packed.perm is not None) == act_order
    assert outputs == reference_greedy(tiny_models[kind], dequantized, prompts)


def test_the_dequantized_path_without_kernels(tiny_models, tmp_path, monkeypatch):
    """A machine without AVX2 (or a compiler) computes with the dequantized weights."""
    monkeypatch.setattr(packed_int, "kernels_available", lambda: False)
    dequantized = write_packed_checkpoint(tiny_models["llama"], tmp_path / "llama", "awq")
    prompts, outputs, qkv = generate(tmp_path / "llama")
    assert qkv.packed.block is None
    assert outputs == reference_greedy(tiny_models["llama"], dequantized, prompts)


@pytest.mark.parametrize("symmetric,actorder", [(True, None), (False, "weight")])
def test_compressed_tensors_pack_quantized_unpacks_as_the_library_decompresses(tiny_models, tmp_path, symmetric,
                                                                               actorder):
    """A W4A16 checkpoint compressed by compressed-tensors itself: srv's weights equal the
    library's own decompression exactly, and decode transformers' greedy tokens on them."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP,
                            actorder=actorder)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    def quantize_layer(name, tensor):
        g_idx = group_index(tensor.shape[1], actorder == "group")
        q, zeros, scales = quantize(tensor, 4, g_idx, symmetric)
        state = {"weight": scales[:, g_idx.long()] * (q - zeros[:, g_idx.long()]).float(),
                 "weight_scale": scales, "weight_zero_point": (zeros - 8).to(torch.int8)}
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        decompressed = PackedQuantizationCompressor.decompress({**compressed, "weight_g_idx": g_idx}, scheme)
        return compressed, decompressed["weight"].float()

    source, target = tiny_models["qwen2"], tmp_path / "ct"
    quantization = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                                  "input_activations": None}}}
    dequantized = write_quantized_checkpoint(source, target, quantize_layer, quantization)
    prompts, outputs, qkv = generate(target)
    expected = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.packed.dequantized(), expected)
    assert outputs == reference_greedy(source, dequantized, prompts)


@pytest.mark.parametrize("bad,message", [
    ({"bits": 3}, "3-bit GPTQ"), ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "version": "gemv"}, "version='gemv'")])
def test_layouts_srv_does_not_read_are_refused_by_name(tiny_models, tmp_path, bad, message):
    write_packed_checkpoint(tiny_models["llama"], tmp_path / "m", "gptq")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"].update(bad)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        srv.Engine(model_path=str(tmp_path / "m"), dtype="float32", max_total_tokens=256)


def test_default_model_within_the_stated_bound():
    """The default model quantized at load: 4-bit groups of 32 over the GGUF's own 4-bit values."""
    accuracy = measure_accuracy(srv.Engine, {"dtype": "float32", "quantization": "gptq"})
    assert accuracy.top1_logprob_error <= TOP1_LOGPROB_ERROR_BOUND, accuracy
    assert accuracy.greedy_agreement >= GREEDY_AGREEMENT_BOUND, accuracy
