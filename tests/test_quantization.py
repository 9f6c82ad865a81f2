"""`--quantization gguf`: GGUF blocks recovered exactly from the dequantized weights, the layers
that fit no format left dense, the batch-size dispatch, and the default model served from its
own 4-bit weights. (The QuantizationMethodKit runs in test_sdk_testing; the served model is held
to the bf16 tolerance against HF in test_engine.)"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from torch import nn

import srv
from srv.plugins.quantization.gguf import (DENSE_FROM_FLOAT32_ROWS, GGUFLinear, GGUFQuantization, Q4_1Weight,
                                           Q8_0Weight, q4_1_weight, q8_0_weight, quantized_weight)
from srv.sdk.native import call_linear
from test_engine import BF16_LOGPROB_TOLERANCE
from test_sdk_testing import gguf_weight


def weight(kind: str, rows: int = 96, columns: int = 128, seed: int = 0) -> torch.Tensor:
    return gguf_weight(kind, rows, columns, torch.Generator().manual_seed(seed))


def assert_products_match(quantized, w: torch.Tensor) -> None:
    """The kernels' products equal float64 ones of the file's weights to float32 rounding, for
    row counts on both paths (up to 4 rows scaled in registers, more through widened weight
    rows, in tiles of 4)."""
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 4, 5, 8, 13):
        x = torch.randn(rows, w.shape[1], generator=generator)
        reference = x.double() @ w.double().T
        error = (quantized.matmul(x).double() - reference).abs().max() / reference.abs().max()
        assert error < 1e-5, f"{rows} rows: relative error {error:.1e}"


def instruction_sets() -> list[str]:
    """The few-row products' instruction sets this CPU runs (AVX2 is the kernels' floor)."""
    return ["avx2", "avx512"] if torch.cpu._is_avx512_supported() else ["avx2"]


@pytest.fixture(params=instruction_sets())
def gguf_isa(request):
    from srv.plugins.quantization import gguf

    gguf.set_isa(request.param)
    yield request.param
    gguf.set_isa(None)


@pytest.mark.parametrize("rows, columns", [(96, 128), (95, 96), (96, 32)],
                         ids=["pairs", "odd", "one-block"])
def test_q4_1_blocks_compute_the_file_weights(rows, columns, gguf_isa):
    w = weight("Q4_1", rows, columns)
    quantized = q4_1_weight(w)
    assert isinstance(quantized, Q4_1Weight) and q8_0_weight(w) is None
    assert_products_match(quantized, w)


@pytest.mark.parametrize("rows, columns", [(96, 128), (95, 96)], ids=["even", "odd"])
def test_q8_0_blocks_compute_the_file_weights(rows, columns, gguf_isa):
    w = weight("Q8_0", rows, columns)
    quantized = q8_0_weight(w)
    assert isinstance(quantized, Q8_0Weight) and q4_1_weight(w) is None
    assert_products_match(quantized, w)


@pytest.mark.parametrize("outputs", [96, 95], ids=["even", "odd"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_verify_pass_rows_are_one_row_products_to_the_bit(kind, outputs, gguf_isa):
    """A speculative verify pass (a token and its drafts, up to 8 rows on AVX-512, 4 on AVX2)
    runs the few-row bodies, whose every row sums as a one-row decode step does: verifying a
    draft cannot change the token the step without drafts would have chosen. (An odd count of
    outputs leaves the AVX-512 bodies, which pair output rows, one row alone.)"""
    quantized = quantized_weight(weight(kind, outputs, 576))
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2))
    for rows in range(2, (8 if gguf_isa == "avx512" else 4) + 1):
        together = quantized.matmul(x[:rows])
        for r in range(rows):
            assert torch.equal(together[r], quantized.matmul(x[r:r + 1])[0]), f"{kind}: row {r} of {rows}"


def test_weights_recovered_in_slices_compute_the_whole_weight(monkeypatch):
    monkeypatch.setattr("srv.plugins.quantization.gguf.ROWS_PER_SLICE", 40)
    for kind in ("Q4_1", "Q8_0"):
        w = weight(kind)
        assert_products_match(quantized_weight(w), w)


@pytest.mark.parametrize("w", [
    torch.randn(64, 128),                                             # plain floats
    torch.cat([weight("Q4_1", 64), torch.randn(32, 128)]),             # a fused layer, one part not GGUF
    weight("Q4_1", 64, 128)[:, :100],                                 # rows not made of 32-value blocks
], ids=["float", "mixed", "ragged"])
def test_weights_in_no_supported_format_stay_dense(w):
    assert quantized_weight(w) is None


@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_run_the_kernels_and_large_ones_the_dense_copy(bias):
    dense = nn.Linear(128, 96, bias=bias)
    with torch.no_grad():
        dense.weight.copy_(weight("Q4_1"))
    layer = GGUFLinear(quantized_weight(dense.weight), dense)
    calls = []
    layer.dense.register_forward_hook(lambda *_: calls.append("dense"))
    for rows in (DENSE_FROM_FLOAT32_ROWS - 1, DENSE_FROM_FLOAT32_ROWS):
        x = torch.randn(rows, 128)
        with torch.inference_mode():
            expected = dense(x)
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # One call each to compute the expected products; only the large batch's layer call adds one.
    assert calls == ["dense", "dense", "dense"]


@pytest.mark.parametrize("flags", [{}, {"quantization": "gguf"}], ids=["inferred", "explicit"])
def test_default_model_serves_every_linear_layer_from_its_gguf_blocks(flags):
    """A GGUF file is served from its own blocks unless --quantization says otherwise."""
    with srv.Engine(dtype="float32", **flags) as engine:
        layers = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        config = engine.runner.config
        # Four projections per decoder layer (q/k/v and gate/up fused) and the vocabulary head.
        assert len(layers) == 4 * config.num_hidden_layers + 1
        assert [type(m.weight) for m in layers].count(Q8_0Weight) == 1   # the head: Q8_0 token embeddings
        result = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        assert result["meta_info"]["completion_tokens"] == 8


def test_the_dense_copies_of_gguf_layers_hold_their_weights_once():
    """A GGUF layer's dense copy serves its large batches only: after a prefill its weights are
    oneDNN's blocked copy alone, not also the row-major ones (the GGUF kernels serve decode)."""
    from srv.sdk.packed_linear import PackedLinear, can_pack

    with srv.Engine(dtype="float32") as engine:
        engine.generate("The capital of France is " * 60, {"max_new_tokens": 2, "temperature": 0})
        copies = [m.dense for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        assert copies and all(isinstance(c, PackedLinear) and not c.keep_rows for c in copies)
        if can_pack(torch.float32):
            used = [c for c in copies if c.packed_weight is not None]
            assert used and all(c.weight is None for c in used)


def test_the_dense_copies_are_reordered_in_the_first_pause(monkeypatch):
    """oneDNN's reorders of the dense copies, deferred from the launch, run once the traffic
    pauses, so that the first long prompt does not pay them; a request meanwhile is served."""
    import time

    from srv.sdk.packed_linear import can_pack

    if not can_pack(torch.float32):
        pytest.skip("oneDNN does not compute float32 here")
    monkeypatch.setattr("srv.engine.scheduler.PAUSE_S", 0.05)
    with srv.Engine(dtype="float32") as engine:
        copies = [m.dense for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        assert engine.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
        deadline = time.monotonic() + 60
        while any(c.unpacked for c in copies) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(c.unpacked for c in copies) and all(c.weight is None for c in copies)
        assert engine.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2


PROMPTS = ("The capital of France is", "def fibonacci(n):", "Hi")


def drive_decode_steps(engine, steps: int, tokens: list[torch.Tensor] | None = None,
                       check=None, copies: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill three ragged prompts (each `copies` times), then `steps` decode steps of them all,
    driving the model directly (its own argmax tokens, or `tokens`); `check(step, args, logits)`
    after each step. Returns each step's tokens and logits."""
    runner = engine.runner
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS] * copies
    base = runner.kv_cache.k_buffers[0].shape[0] - 100 * len(prompts) - 212   # slots no request holds
    slots = [torch.arange(base + 100 * i, base + 100 * (i + 1)) for i in range(len(prompts))]
    for buffer in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers:
        buffer[base:base + 100 * len(prompts)] = float("nan")   # a read of a slot not written yet shows

    def slot_table(lens: list[int]) -> torch.Tensor:
        """Each row's slots, 0 past its length (never-written slots may hold NaNs)."""
        table = torch.stack([s[:max(lens)] for s in slots])
        for i, n in enumerate(lens):
            table[i, n:] = 0
        return table

    lens = [len(p) for p in prompts]
    logits = runner.forward(torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens]),
                            torch.cat([s[:n] for s, n in zip(slots, lens)]), slot_table(lens), [0] * len(prompts), lens).logits
    all_tokens, all_logits = [], []
    for step in range(steps):
        assert torch.isfinite(logits).all()
        step_tokens = logits.argmax(-1) if tokens is None else tokens[step]
        args = (step_tokens, torch.tensor(lens), torch.stack([s[n] for s, n in zip(slots, lens)]),
                slot_table([n + 1 for n in lens]), lens, [1] * len(prompts))
        logits = runner.forward(*args).logits
        all_tokens.append(step_tokens)
        all_logits.append(logits)
        if check is not None:
            check(step, args, logits)
        lens = [n + 1 for n in lens]
    return all_tokens, all_logits


def gaps(reference: list[torch.Tensor], logits: list[torch.Tensor]) -> list[float]:
    """Per step, the largest log-probability difference on the reference's top 5."""
    return [float((torch.log_softmax(want, -1) - torch.log_softmax(got, -1)).gather(1, want.topk(5, -1).indices)
                  .abs().max()) for want, got in zip(reference, logits)]


def count_native_steps(monkeypatch) -> list[bool]:
    from srv.plugins.models.llama import LlamaForCausalLM

    native_steps: list[bool] = []
    decode_natively = LlamaForCausalLM._decode_natively

    def counted(self, *args):
        native = decode_natively(self, *args)
        native_steps.append(native is not None)
        return native

    monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", counted)
    return native_steps


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["gguf-blocks", "dense"])
def test_decode_layers_run_in_one_native_call_with_the_python_layers_results(monkeypatch, quantization):
    """In float32, a decode step's layers run in C (srv_decode_layers), calling the kernels the
    Python layers call, in the same order: the same logits to the bit, step after step, for a
    batch of ragged contexts (the model driven directly, so that both see the same batches).
    Dense weights (the file dequantized) take the row-major kernel of srv.sdk.packed_linear."""
    from srv.plugins.models.llama import LlamaForCausalLM

    native_steps = count_native_steps(monkeypatch)
    counted = LlamaForCausalLM._decode_natively

    def same_as_python(step, args, logits):
        monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", lambda self, *args: None)
        assert torch.equal(engine.runner.forward(*args).logits, logits), f"decode step {step}"
        monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", counted)

    outside = []

    def outside_the_vocabulary(step, args, logits):
        """A token the embedding matrix lacks fails the step as torch's look-up does (nothing read)."""
        if step == 0:
            ids = args[0].clone()
            ids[1] = engine.runner.config.vocab_size
            with pytest.raises(IndexError):
                engine.runner.forward(ids, *args[1:])
            outside.append(step)
        same_as_python(step, args, logits)

    with srv.Engine(quantization=quantization, dtype="float32") as engine:
        drive_decode_steps(engine, 4, check=outside_the_vocabulary)
    assert native_steps == [False] + [True] * 4, "the decode steps did not run natively"
    assert outside == [0]


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["gguf-blocks", "dense"])
def test_a_bf16_model_decodes_small_batches_natively_in_float32(monkeypatch, quantization):
    """Served in bf16, a GGUF file's small decode steps run the native layers in float32 on the
    bf16 KV cache (its blocks, or its bf16 weights dequantized): their log-probabilities are no
    further from the float32 model's than those of the Python layers' bf16 arithmetic (nor than
    bf16's tolerance)."""
    from srv.plugins.models.llama import LlamaForCausalLM

    with srv.Engine(dtype="float32") as engine:
        tokens, reference = drive_decode_steps(engine, 6)
    with srv.Engine(dtype="bfloat16", quantization=quantization) as engine:
        assert engine.runner.dtype == torch.bfloat16
        native_steps = count_native_steps(monkeypatch)
        _, native = drive_decode_steps(engine, 6, tokens)
        monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", lambda self, *args: None)
        _, python = drive_decode_steps(engine, 6, tokens)
    assert native_steps == [False] + [True] * 6, "the bf16 model's decode steps did not run natively"
    assert max(gaps(reference, native)) <= max(max(gaps(reference, python)), BF16_LOGPROB_TOLERANCE)


def test_a_bf16_model_decodes_larger_batches_natively_in_bf16_arithmetic(monkeypatch):
    """Served in bf16, a GGUF file's decode steps of FLOAT32_DECODE_ROWS rows and more run the
    native layers with the products in bf16 arithmetic, where the CPU has bf16 products: the
    kernel's products equal bf16-rounded rows and weights summed in float32, and the steps'
    log-probabilities are no further from the float32 model's than the Python layers' are (nor
    than bf16's tolerance)."""
    from srv.plugins.models import llama
    from srv.plugins.quantization.gguf import has_bf16_products

    if not has_bf16_products():
        pytest.skip("this CPU has no bf16 products (AVX512_BF16)")
    copies = -(-llama.FLOAT32_DECODE_ROWS // len(PROMPTS))
    assert llama.FLOAT32_DECODE_ROWS <= copies * len(PROMPTS) < llama.BF16_DECODE_ROWS
    with srv.Engine(dtype="float32") as engine:
        tokens, reference = drive_decode_steps(engine, 4, copies=copies)
    with srv.Engine(dtype="bfloat16") as engine:
        native_steps = count_native_steps(monkeypatch)
        _, native = drive_decode_steps(engine, 4, tokens, copies=copies)
        monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_natively", lambda self, *args: None)
        _, python = drive_decode_steps(engine, 4, tokens, copies=copies)
    assert native_steps == [False] + [True] * 4, "the bf16 model's larger decode steps did not run natively"
    assert max(gaps(reference, native)) <= max(max(gaps(reference, python)), BF16_LOGPROB_TOLERANCE)


def test_larger_bf16_decode_steps_run_the_python_layers_without_bf16_products(monkeypatch):
    """Where a product offers no bf16 kernel (a CPU without bf16 products), the larger decode
    steps of a bf16 model run the Python layers."""
    offer = GGUFLinear.native_linear
    monkeypatch.setattr(GGUFLinear, "native_linear", lambda self, rows, dtype=torch.float32:
                        offer(self, rows) if dtype == torch.float32 else None)
    with srv.Engine(dtype="bfloat16") as engine:
        native_steps = count_native_steps(monkeypatch)
        drive_decode_steps(engine, 2, copies=4)
    assert native_steps == [False] * 3


def test_bf16_kernels_serve_decode_steps_up_to_where_the_dense_copy_is_faster():
    """A GGUF layer offers its bf16 kernel to native decode steps below AMX_DENSE_FROM_ROWS rows
    where AMX computes it, below BF16_KERNEL_ROWS elsewhere (vdpbf16ps), and never without bf16
    products; float32 rows get the float32 kernel either way."""
    from srv.plugins.quantization import gguf

    dense = nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        dense.weight.copy_(weight("Q4_1"))
    layer = GGUFLinear(quantized_weight(dense.weight), dense)
    limit = gguf.AMX_DENSE_FROM_ROWS if gguf.has_amx() else gguf.BF16_KERNEL_ROWS
    offered = [rows for rows in range(1, DENSE_FROM_FLOAT32_ROWS) if layer.native_linear(rows, torch.bfloat16)]
    assert offered == (list(range(1, limit)) if gguf.has_bf16_products() else [])
    assert all(layer.native_linear(rows) is not None for rows in (1, 40, DENSE_FROM_FLOAT32_ROWS - 1))


@pytest.mark.parametrize("isa", ["avx512", "amx"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_bf16_products_round_rows_and_weights_to_bf16(kind, isa):
    """On either body (vdpbf16ps, or AMX's tiles: 16 outputs by 16 rows a tile, so 40 outputs
    and 17 or 40 rows leave part tiles, and 33 rows a third group)."""
    from srv.plugins.quantization import gguf

    if not gguf.has_bf16_products():
        pytest.skip("this CPU has no bf16 products (AVX512_BF16)")
    if isa == "amx" and not gguf.has_amx():
        pytest.skip("this CPU has no AMX-BF16 (or the OS does not lend its tiles)")
    w = weight(kind, 40, 96)
    quantized = (q4_1_weight if kind == "Q4_1" else q8_0_weight)(w)
    gguf.set_isa(isa)
    try:
        for rows in (1, 5, 13, 17, 33, 40):
            x = torch.randn(rows, 96)
            reference = x.bfloat16().double() @ w.bfloat16().double().t()
            product = call_linear(quantized.bf16_kernel, x, 40).double()
            error = (product - reference).abs().max() / reference.abs().max()
            assert error < 1e-5, f"{rows} rows: relative error {error:.1e}"
    finally:
        gguf.set_isa(None)


def test_quantization_none_serves_a_gguf_file_dequantized():
    with srv.Engine(quantization="none", dtype="float32") as engine:
        assert not [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]


def test_a_config_that_declares_its_quantization_gets_that_method(tiny_models, tmp_path, caplog):
    declared = tmp_path / "declared"
    shutil.copytree(tiny_models["llama"], declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    with pytest.raises(ValueError, match="--quantization gguf serves a .gguf file"):
        srv.Engine(model_path=str(declared))
    (declared / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "unheard_of"}}))
    with caplog.at_level("WARNING"), srv.Engine(model_path=str(declared), dtype="float32") as engine:
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]
    assert "declares quantization 'unheard_of', which no installed plugin provides" in caplog.text


def test_gguf_quantization_refuses_a_model_that_is_not_gguf(tiny_models):
    with pytest.raises(ValueError, match="--quantization gguf serves a .gguf file"):
        srv.Engine(model_path=str(tiny_models["llama"]), quantization="gguf")


def test_unpacked_weights_are_cached_per_file_and_layers(tmp_path, monkeypatch):
    from test_gguf_convert import write_tiny_gguf

    monkeypatch.setenv("SRV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", 32)
    unpacked = []
    real = GGUFQuantization._file_weights
    monkeypatch.setattr(GGUFQuantization, "_file_weights",
                        lambda self, *args: unpacked.append(1) or real(self, *args))

    def kernels_of(flags=None):
        with srv.Engine(model_path=str(path), dtype="float32", max_total_tokens=256, **(flags or {})) as engine:
            return {name: m.weight for name, m in engine.runner.model.named_modules() if isinstance(m, GGUFLinear)}

    first = kernels_of()
    second = kernels_of()
    assert unpacked == [1], "the second launch unpacked the blocks again instead of reading the cache"
    assert first.keys() == second.keys() and first
    for name, weight in first.items():
        assert type(second[name]) is type(weight)
        for field, tensor in weight.tensors().items():
            assert torch.equal(second[name].tensors()[field], tensor), (name, field)
    path.write_bytes(path.read_bytes())   # the same bytes, a new modification time: another entry
    kernels_of()
    assert len(unpacked) == 2


# Every block type srv unpacks, in the projections of a tiny Llama (K-quants need 256 inputs),
# the query and value projections of different layouts so that the fused layer mixes them.
MIXED_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q2_K",
     "ffn_up": "Q3_K", "ffn_down": "Q6_K", "output": "Q4_K"},
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
     "ffn_up": "Q5_1", "ffn_down": "Q8_0", "output": "Q6_K"},
]


@pytest.mark.parametrize("types", MIXED_TYPES, ids=["k-quants", "legacy"])
def test_every_block_type_is_read_from_the_file_and_matches_transformers(tmp_path, types):
    """Each layer's kernel weights rebuild gguf's own dequantized values exactly (the loader's
    dense copy), and greedy decoding matches transformers' GGUF loader on the same file."""
    from test_gguf_convert import reference_model, write_tiny_gguf

    from srv.sdk.testing.tiny_model import hf_greedy

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", 64, types=types, hidden=256, ffn=512)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 30]]
    with srv.Engine(model_path=str(path), quantization="gguf", dtype="float32", max_total_tokens=1024) as engine:
        layers = {name: m for name, m in engine.runner.model.named_modules() if isinstance(m, GGUFLinear)}
        assert len(layers) == 2 * 4 + 1, sorted(layers)
        for name, layer in layers.items():
            assert torch.equal(dequantized(layer.weight), layer.dense.weight.float()), name
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                      "ignore_eos": True})
    reference = reference_model(path).eval()
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 6) for p in prompts]


def dequantized(weight) -> torch.Tensor:
    """A kernel layout's weights as floats: w = scale * q (+ min), by the same one rounding."""
    x = torch.eye(weight.in_features)
    columns = [weight.matmul(x[i:i + 1]) for i in range(weight.in_features)]   # one-hot rows: exact
    return torch.cat(columns).t()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_each_block_type_unpacks_to_ggufs_own_dequantized_values(kind):
    import gguf
    import numpy as np
    from test_gguf_convert import random_blocks

    from srv.plugins.quantization import gguf_blocks

    rng = np.random.default_rng(0)
    rows, columns = 24, 512
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        data = (rng.standard_normal((rows, columns)) * 0.1).astype(np.float32)
        raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind])
    else:
        raw = random_blocks(kind, rows, columns, rng)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]),
                                           dtype=np.float32).reshape(rows, columns))
    assert torch.equal(gguf_blocks.dequantized(*gguf_blocks.unpacked(kind, raw, rows)), expected)
    weight = gguf_blocks.layer_weight([(kind, raw, rows)])
    for m in (1, 3, 5, 40):
        x = torch.randn(m, columns)
        torch.testing.assert_close(weight.matmul(x), (x.double() @ expected.double().t()).float(), rtol=1e-5,
                                   atol=1e-4)


@pytest.mark.parametrize("down_type", ["IQ4_NL"])
def test_a_block_type_without_kernel_is_refused_by_name_or_served_dequantized(tmp_path, caplog, down_type):
    """A file whose linear layers hold blocks srv has no kernel for: `--quantization gguf` refuses
    it naming the type; inferred, the file is served dequantized, with a warning that says so."""
    from test_gguf_convert import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", 32, down_type=down_type)
    with pytest.raises(ValueError, match=rf"--quantization gguf: tiny.gguf has {down_type} blocks \(2 tensors, "
                                         rf"blk.0.ffn_down.weight is {down_type}\); srv's kernels compute Q4_0, "
                                         ".*; --quantization none serves it dequantized"):
        srv.Engine(model_path=str(path), quantization="gguf")
    with srv.Engine(model_path=str(path), dtype="float32", max_total_tokens=1024) as engine:
        assert not any(isinstance(m, GGUFLinear) for m in engine.runner.model.modules())
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]
    assert f"has {down_type} blocks" in caplog.text and "serving it dequantized" in caplog.text


def test_tensor_types_read_from_the_header_match_gguf_reader(tmp_path):
    """srv's header reader (milliseconds) against gguf's own (seconds), on the default file and a
    tiny one with other block types."""
    from gguf import GGUFReader
    from test_gguf_convert import write_tiny_gguf

    from srv.engine.default_model import default_model_path
    from srv.plugins.quantization.gguf import tensor_types

    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", 16, bias=True, down_type="Q5_0")
    for path in (default_model_path(), tmp_path / "tiny.gguf"):
        assert tensor_types(path) == {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def test_a_gguf_header_is_read_once_while_the_file_stays_the_same(tmp_path):
    """A launch asks for the header several times; a file rewritten in place is read again."""
    from test_gguf_convert import write_tiny_gguf

    from srv.plugins.quantization.gguf import tensor_infos

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", 16, bias=True, down_type="Q5_0")
    first = tensor_infos(path)
    assert tensor_infos(path) is first
    write_tiny_gguf(path, "qwen2", 16, bias=True, down_type="Q8_0")
    assert tensor_infos(path)["blk.0.ffn_down.weight"].kind == "Q8_0"


def test_gguf_header_is_read_once_and_kept_in_the_cache(tmp_path, monkeypatch):
    """A later launch takes the tensors' types and offsets from srv's cache, without parsing the
    header (or importing gguf) again; a changed file is parsed anew."""
    import os
    import shutil

    from srv.engine.default_model import default_model_path
    from srv.plugins.quantization import gguf as gguf_method

    monkeypatch.setenv("SRV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), model)
    gguf_method._cached_tensor_infos.cache_clear()
    parsed = gguf_method.tensor_infos(model)
    assert list((tmp_path / "cache" / "gguf-headers").iterdir())

    def no_parsing(data):
        raise AssertionError("the header was parsed again")

    gguf_method._cached_tensor_infos.cache_clear()
    monkeypatch.setattr(gguf_method, "_header_tensor_infos", no_parsing)
    assert gguf_method.tensor_infos(model) == parsed
    os.utime(model, ns=(1, 1))   # another file at the same path
    gguf_method._cached_tensor_infos.cache_clear()
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_method.tensor_infos(model)
    gguf_method._cached_tensor_infos.cache_clear()


def test_gguf_header_memo_that_is_not_a_table_is_parsed_anew(tmp_path, monkeypatch):
    from srv.engine.default_model import default_model_path
    from srv.plugins.quantization import gguf as gguf_method

    monkeypatch.setenv("SRV_CACHE_DIR", str(tmp_path))
    gguf_method._cached_tensor_infos.cache_clear()
    parsed = gguf_method.tensor_infos(default_model_path())
    (memo,) = (tmp_path / "gguf-headers").iterdir()
    for text in ("[1, 2]", "{\"a\": 3}", "not json"):
        memo.write_text(text)
        gguf_method._cached_tensor_infos.cache_clear()
        assert gguf_method.tensor_infos(default_model_path()) == parsed
    gguf_method._cached_tensor_infos.cache_clear()
