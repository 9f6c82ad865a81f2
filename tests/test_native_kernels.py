"""srv.sdk.native (C kernels built on first use, cached, errors that say why), srv.sdk.paths'
atomic writes, the Llama family's C norms, rotary embedding and gated activation against the
torch operators they replace, its oneDNN-packed linear layers, the decode attention kernel (its
store into a narrower cache, its groups of requests that share a prefix) and each instruction
set's body of the prefill attention kernel."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import srv.plugins.models.llama as llama
from srv.plugins.attention import cpu_attention
from srv.plugins.attention.cpu_attention import EXTEND_ISAS, CPUAttention
from srv.plugins.attention.torch_native import TorchNativeAttention
from srv.sdk.attention import ForwardBatch
from srv.sdk import packed_linear
from srv.sdk.packed_linear import NATIVE_ROWS, PackedLinear, can_pack, pack_linear_layers
from srv.sdk.registration import requires_cpu_flags
from srv.sdk.testing.attention import BATCHES, BatchShape, make_case, run
from srv.sdk.native import (HUGE_PAGE, NativeBuildError, in_huge_pages, load_c_library, optional_c_library,
                             together_in_huge_pages)
from srv.sdk.paths import write_atomically


def test_a_kernel_compiles_once_and_loads_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SRV_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "add.c"
    source.write_text("long srv_add(long a, long b) { return a + b; }\n")
    assert load_c_library(source).srv_add(2, 3) == 5
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    load_c_library.cache_clear()
    assert load_c_library(source).srv_add(4, 5) == 9
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()] == [stamp]


def test_a_source_that_does_not_compile_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SRV_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int srv_broken( { }\n")
    with pytest.raises(NativeBuildError, match="broken.c"):
        load_c_library(source)
    assert not list((tmp_path / "cache").iterdir())   # nothing half-built is left to load


def test_an_optional_library_that_cannot_be_built_is_none_and_says_what_runs_instead(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SRV_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int srv_broken( { }\n")
    with caplog.at_level("WARNING", logger="srv.native"):
        assert optional_c_library(source, without="torch's operators run instead") is None
    assert "broken.c" in caplog.text and "torch's operators run instead" in caplog.text
    source.write_text("int srv_add(int a, int b) { return a + b; }\n")
    assert optional_c_library(source).srv_add(2, 3) == 5


def test_a_tensor_copied_into_huge_pages_is_equal_aligned_and_outlives_its_original():
    import gc

    original = torch.randn(3, 700, 1000).to(torch.bfloat16)
    expected = original.clone()
    copy = in_huge_pages(original)
    del original
    gc.collect()
    assert copy.data_ptr() % HUGE_PAGE == 0 and copy.is_contiguous()
    assert copy.dtype == torch.bfloat16 and torch.equal(copy, expected)
    copy.add_(1)   # writable, its own memory
    small = torch.ones(10)
    assert in_huge_pages(small) is small


def test_tensors_copied_together_into_huge_pages_lie_back_to_back_in_order():
    tensors = [torch.randn(700, 1000), torch.randint(-127, 128, (3, 33), dtype=torch.int8),
               torch.randn(500, 576).to(torch.bfloat16)]
    copies = together_in_huge_pages(tensors)
    assert all(torch.equal(c, t) and c.dtype == t.dtype and c is not t for c, t in zip(copies, tensors))
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    for before, after in zip(copies, copies[1:]):   # each at the next cache line past the one before
        end = before.data_ptr() + before.numel() * before.element_size()
        assert after.data_ptr() == -(-end // 64) * 64
    small = [torch.ones(10), torch.ones(20)]
    assert all(c is t for c, t in zip(together_in_huge_pages(small), small))


def test_write_atomically_replaces_whole_files_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "cache" / "entry.bin"
    write_atomically(target, lambda tmp: tmp.write_bytes(b"first"))
    write_atomically(target, lambda tmp: tmp.write_bytes(b"second"), mode=0o644)
    assert target.read_bytes() == b"second" and target.stat().st_mode & 0o777 == 0o644

    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, half_then_fail)
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["entry.bin"]


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("srv.sdk.native.compiler", lambda: None)
    source = tmp_path / "x.c"
    source.write_text("int srv_x(void) { return 1; }\n")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        load_c_library(source)


def torch_operators(monkeypatch):
    monkeypatch.setattr(llama, "kernels", lambda: None)


# 70 x 576 values: above the count from which the kernels take threads
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 100), (3, 5), (70, 576)])
def test_rms_norm_kernel_matches_torch(monkeypatch, rows, hidden):
    assert llama.kernels() is not None
    norm = llama.RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    wide = torch.randn(rows, hidden + 9)
    x = wide[:, 3:3 + hidden]                      # rows with a stride of their own
    with torch.inference_mode():
        fused = norm(x)
        torch_operators(monkeypatch)
        reference = norm(x)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 100), (3, 5), (70, 576)])
def test_add_rms_norm_kernel_matches_torch(monkeypatch, rows, hidden):
    norm = llama.RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    with torch.inference_mode():
        fused_residual = residual.clone()
        fused, returned = norm(x, fused_residual)
        assert returned is fused_residual      # the sum is written in place
        torch_operators(monkeypatch)
        reference, reference_residual = norm(x, residual)
    torch.testing.assert_close(fused_residual, reference_residual, rtol=0, atol=0)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, size", [(1, 1536), (4, 37)])
def test_silu_mul_kernel_matches_torch(monkeypatch, rows, size):
    mlp = llama.MLP(SimpleNamespace(hidden_size=8, intermediate_size=size))
    gate_up = torch.randn(rows, 2 * size) * 4
    mlp.gate_up_proj, mlp.down_proj = nn.Identity(), nn.Identity()   # the activation alone
    with torch.inference_mode():
        fused = mlp(gate_up)
        torch_operators(monkeypatch)
        reference = mlp(gate_up)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [5, 300])
@pytest.mark.parametrize("heads, head_dim", [(12, 64), (3, 10)])
def test_rotary_kernel_matches_torch(monkeypatch, heads, head_dim, tokens):
    assert llama.kernels() is not None
    rotary = llama.RotaryEmbedding(head_dim, 10000.0, None)
    cos, sin = rotary(torch.arange(tokens) * 7 % 4096, 4096)
    qkv = torch.randn(tokens, (heads + 2) * head_dim)
    fused, reference = qkv.clone(), qkv.clone()
    with torch.inference_mode():
        # in place, on the q/k part of a fused projection
        llama.apply_rotary(fused[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
        torch_operators(monkeypatch)
        llama.apply_rotary(reference[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused[:, heads * head_dim:], qkv[:, heads * head_dim:])


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_tables_hold_each_positions_values_as_the_operators_give_them_alone(head_dim):
    """The tables the rotary embedding computes once hold, for each position, the values of the
    operators that computed them for that position alone (each step, before the tables)."""
    rotary = llama.RotaryEmbedding(head_dim, 10000.0, None)
    cos, sin = rotary.tables(5000)
    assert cos.shape[0] >= 5000
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    for position in (0, 1, 7, 129, 4095, 4096, 4999):
        freqs = torch.tensor([position]).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos[position], emb.cos()[0]) and torch.equal(sin[position], emb.sin()[0])
    assert torch.equal(rotary(torch.tensor([3, 0]), 4)[0][:, 0], cos[[3, 0]])


def assert_bf16_rows_match(fused: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16 rows equal torch's but for a rare last-place rounding: the kernels sum squares and
    take exp in another order and formula than torch, so an unrounded float32 value a few units
    of its last place away can round to the neighbouring bf16."""
    assert fused.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), reference.float(), rtol=2 ** -7, atol=1e-30)
    assert (fused != reference).float().mean() < 0.01


@pytest.mark.parametrize("rows, hidden", [(1, 576), (70, 576), (3, 5)])
def test_bf16_norms_match_torch(monkeypatch, rows, hidden):
    """A bf16 model's norms (its prefills): plain, and with the residual's sum rounded to bf16 in
    place, above and below the rows where the kernels take threads."""
    norm = llama.RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x, residual = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, hidden).bfloat16()
    with torch.inference_mode():
        fused = norm(x)
        fused_residual = residual.clone()
        fused_sum, returned = norm(x, fused_residual)
        assert returned is fused_residual
        torch_operators(monkeypatch)
        reference = norm(x)
        reference_sum, reference_residual = norm(x, residual)
    assert torch.equal(fused_residual, reference_residual)
    assert_bf16_rows_match(fused, reference)
    assert_bf16_rows_match(fused_sum, reference_sum)


@pytest.mark.parametrize("tokens", [5, 300])
def test_bf16_rotary_matches_torch(monkeypatch, tokens):
    heads, head_dim = 12, 64
    rotary = llama.RotaryEmbedding(head_dim, 10000.0, None)
    cos, sin = rotary(torch.arange(tokens) * 7, 7 * tokens)
    qkv = torch.randn(tokens, (heads + 2) * head_dim).bfloat16()
    fused, reference = qkv.clone(), qkv.clone()
    with torch.inference_mode():
        llama.apply_rotary(fused[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
        torch_operators(monkeypatch)
        llama.apply_rotary(reference[:, :heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    assert_bf16_rows_match(fused, reference)
    assert torch.equal(fused[:, heads * head_dim:], qkv[:, heads * head_dim:])


@pytest.mark.skipif(not can_pack(torch.float32), reason="needs oneDNN")
def test_packed_linear_reorders_its_weight_at_its_first_product():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(3, 5, 64, generator=generator)
    layer = PackedLinear(weight, bias)
    assert layer.packed_weight is None
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
    assert layer.packed_weight is not None and layer.weight is None
    torch.testing.assert_close(layer(x[0]), F.linear(x[0], weight, bias))


def instruction_sets() -> list[str]:
    """The dense kernel's instruction sets this CPU can run: the portable one always."""
    sets = ["portable"]
    if torch.cpu._is_avx2_supported():
        sets.append("avx2")
    if torch.cpu._is_avx512_supported():
        sets.append("avx512")
    return sets


@pytest.fixture
def dense_isa(request):
    packed_linear.set_isa(request.param)
    yield request.param
    packed_linear.set_isa(None)


@pytest.mark.skipif(not can_pack(torch.float32), reason="needs oneDNN")
@pytest.mark.parametrize("dense_isa", instruction_sets(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (7, 13), (1030, 600)],
                         ids=["tiles", "ragged", "threaded"])
def test_row_major_kernel_computes_float64_products_for_every_instruction_set(dense_isa, dtype, out_features,
                                                                            in_features):
    """Weights not a whole number of tiles (4 rows) or of vectors (16 or 8 inputs), each count of
    rows below NATIVE_ROWS (tiles of 4 rows and the remainder), a bias, and a layer large enough for
    both threads: float32 sums of float32 or bf16 weights, against float64 ones."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    layer = PackedLinear(weight, bias, keep_rows=True)
    for rows in range(1, NATIVE_ROWS[dtype]):
        x = torch.randn(rows, in_features, generator=generator)
        reference = x.double() @ weight.double().T + bias.double()
        error = (layer(x).double() - reference).abs().max() / reference.abs().max()
        assert error < 1e-5, f"{rows} rows: relative error {error:.1e}"
    assert layer.packed_weight is None   # no oneDNN product yet
    x = torch.randn(NATIVE_ROWS[dtype], in_features, generator=generator).to(dtype)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
    # Both layouts held (the blocked one only where oneDNN computes the dtype).
    assert (layer.packed_weight is not None) == can_pack(dtype) and layer.weight is not None


def test_a_dtype_onednn_cannot_compute_keeps_its_rows_and_takes_f_linear_for_large_products(monkeypatch):
    """bf16 on a CPU without AVX-512 BF16 (Zen 3): no blocked copy; small float32 steps are the
    row-major kernel's, larger ones F.linear's, and the model still gets the kernel for C."""
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype: dtype == torch.float32)
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96)).to(torch.bfloat16)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    pack_linear_layers(model)
    layer = model[0]
    assert isinstance(layer, PackedLinear) and layer.native_linear(1) is not None
    small = torch.randn(2, 64, generator=generator)
    torch.testing.assert_close(layer(small), small @ weight.float().T + bias.float())
    large = torch.randn(NATIVE_ROWS[torch.bfloat16], 64, generator=generator).to(torch.bfloat16)
    assert torch.equal(layer(large), F.linear(large, weight, bias))
    assert layer.packed_weight is None and layer.weight is not None


@pytest.mark.skipif(not can_pack(torch.float32), reason="needs oneDNN")
def test_row_major_weights_are_kept_only_where_memory_allows(monkeypatch):
    """The blocked copy needs as much memory again as the row-major weights: with too little
    available they are dropped at the first product and no kernel is offered."""
    def model():
        return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))

    roomy = model()
    pack_linear_layers(roomy)
    assert all(layer.native_linear(1) is not None and layer.native_linear(NATIVE_ROWS[torch.float32]) is None
               for layer in roomy)
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: 1000)
    tight = model()
    pack_linear_layers(tight)
    assert all(layer.native_linear(1) is None for layer in tight)
    tight(torch.randn(1, 64))
    assert all(layer.weight is None for layer in tight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_decode_attention_rounds_float32_keys_into_the_cache_as_torch_does(dtype):
    case = make_case(BATCHES["decode"])
    backend = CPUAttention(case.num_heads, case.num_kv_heads, case.head_dim, case.head_dim ** -0.5)
    batch = case.batch(backend, dtype)
    backend.prepare(batch)
    q, k, v = (torch.randn(t.shape) * 300 for t in case.qkv[0])
    k[0, 0, :3] = torch.tensor([torch.finfo(torch.float32).max, 1 + 2 ** -8, -(1 + 3 * 2 ** -9)])
    backend.forward(q, k, v, 0, batch)
    loc = batch.out_cache_loc
    assert torch.equal(batch.kv_cache.k_buffers[0][loc], k.to(dtype))
    assert torch.equal(batch.kv_cache.v_buffers[0][loc], v.to(dtype))


def one_request(batch: ForwardBatch, i: int) -> ForwardBatch:
    """Request i of a decode batch as a batch of its own, over the same cache."""
    return ForwardBatch(input_ids=batch.input_ids[i:i + 1], positions=batch.positions[i:i + 1],
                        out_cache_loc=batch.out_cache_loc[i:i + 1],
                        kv_slots=batch.kv_slots[i:i + 1, :batch.prefix_lens[i] + 1],
                        prefix_lens=[batch.prefix_lens[i]], extend_lens=[1], kv_cache=batch.kv_cache,
                        attention=batch.attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (9, 3), (8, 1)],
                         ids=["kv-heads-2", "kv-heads-3", "kv-heads-1"])
def test_decode_attention_over_a_shared_prefix_gives_each_request_its_output_alone(dtype, num_heads, num_kv_heads):
    """Requests whose slot tables begin alike attend in groups, the shared keys and values read
    once a group; each request's output must be, to the bit, what it is in a batch of its own
    (where KV heads that do not split evenly over the threads are cut in parts: attend_alone)."""
    case = make_case(BATCHES["shared_prefix_decode"], num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    used = set(case.kv_slots.flatten().tolist())
    unused = [s for s in range(16, case.k_buffers[0].shape[0]) if s not in used]
    case.kv_slots[3, :128] = torch.tensor(unused[:128])   # request 3 shares nothing: the groups break there
    backend = CPUAttention(case.num_heads, case.num_kv_heads, case.head_dim, case.head_dim ** -0.5)
    batch = case.batch(backend, dtype)
    backend.prepare(batch)
    context = batch.metadata["cpu_attention"].context
    groups = batch.metadata["cpu_attention"].tensors[-1][:context.group_count].tolist()
    assert [3, 1, 0] in groups and any(count > 1 and shared == 128 for _, count, shared in groups), groups
    together = [backend.forward(q, k, v, layer, batch) for layer, (q, k, v) in enumerate(case.qkv)]
    for i in range(len(case.prefix_lens)):
        alone = one_request(case.batch(backend, dtype), i)
        backend.prepare(alone)
        for layer, (q, k, v) in enumerate(case.qkv):
            out = backend.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], layer, alone)
            assert torch.equal(out[0], together[layer][i]), f"request {i}, layer {layer}"


@pytest.mark.parametrize("isa", [name for name, flags in EXTEND_ISAS.items() if requires_cpu_flags(*flags)().ok])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 40), (4, 4, 100)],
                         ids=["kv-heads-3", "kv-heads-1-head-dim-40", "kv-heads-4-head-dim-100"])
def test_prefill_attention_kernel_matches_the_reference_in_each_instruction_set(isa, dtype, num_heads, num_kv_heads,
                                                                               head_dim, monkeypatch):
    """Every body this CPU runs (the conformance kit checks only the one picked), over prompts,
    prefix hits and a batch of both whose requests span several of the kernel's chunks and item
    blocks, on head sizes that do not fill a vector."""
    monkeypatch.setenv("SRV_EXTEND_ATTENTION_ISA", isa)
    monkeypatch.setattr(cpu_attention, "extend_isa", functools.cache(cpu_attention.extend_isa.__wrapped__))
    case = make_case(BatchShape([0, 300, 3, 130], [200, 45, 1, 37]), num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype)
    expected, _ = run(TorchNativeAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5), case, torch.float32)
    actual, batch = run(CPUAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5), case, dtype)
    assert isinstance(batch.metadata["cpu_attention"], cpu_attention.ExtendStep)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    for layer, (out, ref) in enumerate(zip(actual, expected)):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"layer {layer}: {m}")
