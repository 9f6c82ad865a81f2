"""The MoE runners pass srv's conformance kit (srv.sdk.testing.MoERunnerKit); the fused C
runner's portable kernels (no vector instructions) give what the vectorised ones give."""

from __future__ import annotations

import pytest
import torch

import srv.plugins.moe.fused_cpu as fused_cpu
from srv.sdk.moe import ExpertWeights, Routing, select_experts
from srv.sdk.testing import MoERunnerKit


class TestTorchRunner(MoERunnerKit):
    backend_name = "torch"


class TestFusedCPURunner(MoERunnerKit):
    backend_name = "fused_cpu"


@pytest.fixture
def c_only(monkeypatch):
    # Every batch through the C kernel (larger ones go to torch's products by default).
    monkeypatch.setattr(fused_cpu, "TORCH_ROWS_PER_EXPERT", 10 ** 9)


class TestFusedCPURunnerInC(MoERunnerKit):
    backend_factory = fused_cpu.FusedCPURunner

    @pytest.fixture(autouse=True)
    def _c_only(self, c_only):
        pass


def experts_of_size(generator: torch.Generator, dtype, hidden: int, inter: int) -> ExpertWeights:
    w13 = torch.randn(8, 2 * inter, hidden, generator=generator) * 0.2
    w2 = torch.randn(8, hidden, inter, generator=generator) * 0.2
    if dtype != "int8":
        return ExpertWeights(w13.to(dtype), w2.to(dtype), 0, 8)
    scales = [w.abs().amax(-1) / 127 for w in (w13, w2)]
    q13, q2 = ((w / s[..., None]).round().to(torch.int8) for w, s in zip((w13, w2), scales))
    return ExpertWeights(q13, q2, 0, 8, "silu", *scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("tokens, hidden, inter", [(37, 64, 48), (3, 45, 37), (80, 64, 36)])
# 45, 37: no whole vectors; 80 tokens and 72 gate-up rows: two groups of rows a tile and rows past the last tile
def test_every_instruction_sets_kernels_give_the_same_products(dtype, tokens, hidden, inter, c_only):
    generator = torch.Generator().manual_seed(0)
    experts = experts_of_size(generator, dtype, hidden, inter)
    x = torch.randn(tokens, hidden, generator=generator)
    x = x if dtype == "int8" else x.to(dtype)
    weights, ids = select_experts(torch.randn(tokens, 8, generator=generator), Routing(2))
    runner = fused_cpu.FusedCPURunner()
    outputs = {}
    try:
        for isa, level in fused_cpu.ISAS.items():   # each this CPU runs
            if level > fused_cpu.kernels().srv_moe_best_isa():
                continue
            fused_cpu.set_isa(isa)
            outputs[isa] = runner.run(x, weights, ids, experts).float()
    finally:
        fused_cpu.set_isa(None)
    reference = outputs["portable"]
    # bf16: the output and the activation between the products are rounded to bf16, where sums
    # in another order may round to the neighbouring value (2^-8 of it at most, then carried on).
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    for isa, out in outputs.items():
        assert (out - reference).abs().max() <= tolerance * reference.abs().max(), isa


def test_the_reference_pads_bf16_row_counts_to_few_sizes_and_drops_the_padding():
    from srv.sdk.moe import padded_rows, run_experts_reference

    assert [padded_rows(n) for n in (1, 2, 3, 5, 16, 17, 32, 33, 100)] == [1, 2, 4, 8, 16, 32, 32, 64, 128]
    generator = torch.Generator().manual_seed(0)
    experts = experts_of_size(generator, torch.bfloat16, 64, 48)
    x = torch.randn(21, 64, generator=generator).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(21, 8, generator=generator), Routing(2))
    expected = torch.zeros(21, 64)
    for token in range(21):
        for weight, expert in zip(weights[token], ids[token].tolist()):
            hidden = torch.nn.functional.silu(x[token:token + 1].float() @ experts.w13[expert, :48].float().t()) * \
                (x[token:token + 1].float() @ experts.w13[expert, 48:].float().t())
            expected[token] += (hidden @ experts.w2[expert].float().t())[0] * weight
    torch.testing.assert_close(run_experts_reference(x, weights, ids, experts).float(), expected, rtol=0.05, atol=0.05)
